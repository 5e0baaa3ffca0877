"""The application a GUI agent operates: one settings page, modelled in plain Python.

Owns: `SettingsApp`: the page's controls (two switches, three dropdowns, a text field, a scrolling
list of app permissions, a Save button), its state (the saved values and the draft being edited),
the four user actions (click, type, select, scroll) and its accessibility tree as text: one line per
element with role, name, element id, value and states, showing only the visible rows of the list.
Does not own: tasks, rewards and tools (`envs.gui`).

Element ids are shuffled per page (`layout` seed), so an agent has to read them from the tree.
"Notification sound" is disabled while "Notifications" is off, and "Save" while nothing changed.
Invalid actions raise `ActionError` with a one-line reason and leave the page as it was.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Literal

SOUNDS = ("Bell", "Chime", "Marimba", "Pulse")
FONT_SIZES = ("12", "14", "16", "18", "20")
LANGUAGES = ("English", "French", "German", "Italian", "Spanish")
APPS = ("Bluetooth", "Calendar", "Camera", "Contacts", "Files", "Health", "Location", "Microphone", "Motion",
        "Music", "Photos", "Reminders")
VISIBLE_ROWS = 4  # rows of the permissions list on screen at once
MAX_TEXT = 40
LIST_NAME, SAVE = "App permissions", "Save"
NOTHING_TO_SAVE = "nothing to save"  # why Save is refused while every change is saved


@dataclass(frozen=True)
class Control:
    """One setting: its accessible name and role; `row` is its place in the scrolling list."""

    name: str
    role: Literal["switch", "combobox", "textbox", "checkbox"]
    options: tuple[str, ...] = ()
    row: int | None = None


CONTROLS = (
    Control("Dark mode", "switch"),
    Control("Notifications", "switch"),
    Control("Notification sound", "combobox", SOUNDS),
    Control("Font size", "combobox", FONT_SIZES),
    Control("Language", "combobox", LANGUAGES),
    Control("Display name", "textbox"),
    *(Control(app, "checkbox", row=i) for i, app in enumerate(APPS)),
)
BY_NAME = {c.name: c for c in CONTROLS}
Value = bool | str


class ActionError(Exception):
    """An action the page refuses (unknown element, wrong kind of action, disabled, not visible)."""


def value_problem(name: str, value: object) -> str | None:
    """Why `value` cannot be the value of setting `name`, or None when it can."""
    control = BY_NAME.get(name)
    if control is None:
        return f"unknown setting {name!r}"
    if control.role in ("switch", "checkbox"):
        return None if isinstance(value, bool) else f"{name!r} must be true or false (got {value!r})"
    if not isinstance(value, str):
        return f"{name!r} must be a string (got {value!r})"
    if control.options and value not in control.options:
        return f"{name!r} must be one of {', '.join(control.options)} (got {value!r})"
    if control.role == "textbox" and not 0 < len(value) <= MAX_TEXT:
        return f"{name!r} must be 1 to {MAX_TEXT} characters (got {len(value)})"
    return None


# -- the page's wording and rules, shared with the browser page (`envs.gui_browser`) ------------
def element_line(role: str, name: str, element: str, value: Value | None, disabled: bool) -> str:
    """One element of the tree, e.g. `combobox "Font size" [e42] value="14" options=12|14|16`."""
    text = f'{role} "{name}" [{element}]'
    if isinstance(value, bool):
        text += " checked" if value else " unchecked"
    elif value is not None:
        text += f" value={json.dumps(value)}"
    if name in BY_NAME and BY_NAME[name].options:
        text += " options=" + "|".join(BY_NAME[name].options)
    return text + (" disabled" if disabled else "")


def status_text(unsaved: int) -> str:
    return f"{unsaved} unsaved change{'s' if unsaved != 1 else ''}" if unsaved else "all changes saved"


def rows_text(top_row: int) -> str:
    """Where the list is scrolled, e.g. "rows 5-8 of 12, more above and below"."""
    last = min(top_row + VISIBLE_ROWS, len(APPS))
    more = [w for w, ok in (("above", top_row > 0), ("below", last < len(APPS))) if ok]
    return f"rows {top_row + 1}-{last} of {len(APPS)}" + (f", more {' and '.join(more)}" if more else "")


def role_of(name: str) -> str:
    return "button" if name == SAVE else BY_NAME[name].role


def refusal(name: str, element: str, action: str, roles: tuple[str, ...], visible: bool,
            disabled: bool) -> ActionError | None:
    """Why the element `element` (named `name`) cannot take `action`, checked in this order."""
    if not visible:
        return ActionError(f"{element} ({name}) is scrolled out of view; scroll the list to it first")
    role = role_of(name)
    if role not in roles:
        use = {"combobox": "select", "textbox": "type"}.get(role, "click")
        return ActionError(f"cannot {action} {element} ({role} {name!r}); use {use}")
    if disabled:
        reason = NOTHING_TO_SAVE if name == SAVE else "turn on Notifications first"
        return ActionError(f"{element} ({name}) is disabled: {reason}")
    return None


def unknown(element: str) -> ActionError:
    return ActionError(f"no element {element!r} on the page; use an id in [brackets] from the tree")


def option_of(name: str, option: str) -> str:
    """The option of dropdown `name` that `option` names (case-blind), or ActionError."""
    options = BY_NAME[name].options
    match = [o for o in options if o.casefold() == option.strip().casefold()]
    if not match:
        raise ActionError(f"{name} has no option {option!r}; options: {', '.join(options)}")
    return match[0]


def now_text(name: str, value: Value) -> str:
    shown = ("checked" if value else "unchecked") if isinstance(value, bool) else json.dumps(value)
    return f"{name} is now {shown}."


def saved_text(count: int) -> str:
    return f"Saved {count} change{'s' if count != 1 else ''}."


def scrolled(top_row: int, direction: str) -> tuple[int, str]:
    """The list's new first row after scrolling one screen, and what to tell the user."""
    if direction not in ("up", "down"):
        raise ActionError(f"cannot scroll {direction!r}; scroll up or down")
    step = VISIBLE_ROWS if direction == "down" else -VISIBLE_ROWS
    top = max(0, min(top_row + step, len(APPS) - VISIBLE_ROWS))
    if top == top_row:
        return top, f"The list is already at the {'bottom' if direction == 'down' else 'top'}."
    return top, f"Scrolled {direction}."


class SettingsApp:
    """A settings page: edit the draft with actions, `saved` changes only when Save is clicked."""

    def __init__(self, values: dict[str, Value], layout: int):
        problems = [p for name in BY_NAME if (p := value_problem(name, values.get(name))) is not None]
        problems += [f"unknown setting {name!r}" for name in values if name not in BY_NAME]
        if problems:
            raise ValueError(problems[0])
        self.saved: dict[str, Value] = {name: values[name] for name in BY_NAME}
        self.draft = dict(self.saved)
        self.top_row = 0  # first visible row of the list
        numbers = random.Random(layout).sample(range(10, 100), len(CONTROLS) + 1)
        self.ids = {name: f"e{n}" for name, n in zip([*BY_NAME, SAVE], numbers)}
        self.names = {eid: name for name, eid in self.ids.items()}

    # -- what the page shows ------------------------------------------------------------------
    def values(self) -> tuple[dict[str, Value], dict[str, Value]]:
        """The saved settings and the draft on screen."""
        return dict(self.saved), dict(self.draft)

    @property
    def unsaved(self) -> list[str]:
        return [name for name in BY_NAME if self.draft[name] != self.saved[name]]

    def disabled(self, name: str) -> bool:
        if name == SAVE:
            return not self.unsaved
        return name == "Notification sound" and not self.draft["Notifications"]

    def visible(self, name: str) -> bool:
        row = BY_NAME[name].row if name in BY_NAME else None
        return row is None or self.top_row <= row < self.top_row + VISIBLE_ROWS

    def line(self, name: str) -> str:
        return element_line(role_of(name), name, self.ids[name], self.draft.get(name), self.disabled(name))

    def tree(self) -> str:
        """The accessibility tree: page controls, the visible list rows, the Save button."""
        lines = [f'page "Settings" ({status_text(len(self.unsaved))})']
        lines += [self.line(c.name) for c in CONTROLS if c.row is None]
        lines.append(f'list "{LIST_NAME}" {rows_text(self.top_row)}')
        lines += ["  " + self.line(app) for app in APPS[self.top_row:self.top_row + VISIBLE_ROWS]]
        lines.append(self.line(SAVE))
        return "\n".join(lines)

    # -- actions: each returns a one-line account of what happened --------------------------
    def _target(self, element: str, action: str, roles: tuple[str, ...]) -> str:
        name = self.names.get(element.strip())
        if name is None:
            raise unknown(element)
        refused = refusal(name, self.ids[name], action, roles, self.visible(name), self.disabled(name))
        if refused:
            raise refused
        return name

    def click(self, element: str) -> str:
        name = self._target(element, "click", ("switch", "checkbox", "button"))
        if name == SAVE:
            count = len(self.unsaved)
            self.saved = dict(self.draft)
            return saved_text(count)
        self.draft[name] = not self.draft[name]
        return now_text(name, self.draft[name])

    def type(self, element: str, text: str) -> str:
        name = self._target(element, "type into", ("textbox",))
        if (problem := value_problem(name, text)) is not None:
            raise ActionError(problem)
        self.draft[name] = text
        return now_text(name, text)

    def select(self, element: str, option: str) -> str:
        name = self._target(element, "select an option of", ("combobox",))
        self.draft[name] = option_of(name, option)
        return now_text(name, self.draft[name])

    def scroll(self, direction: Literal["up", "down"]) -> str:
        self.top_row, said = scrolled(self.top_row, direction)
        return said
