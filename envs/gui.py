"""GUI-agent environment: change settings on a page through its accessibility tree, then save.

Owns: the tasks ("Turn on dark mode, set the font size to 16 and grant the Camera permission, then
save."), generated per seed in three levels (1 to 3 changes, levels 2 and 3 need a scroll), the
four tools (`click`, `type`, `select`, `scroll`: each returns a one-line account and the updated
tree), the `GuiEnv` episode, its reward, `solve`, the scripted demonstration, `mistake`, the
recoverable slips imperfect demonstrations are made of, the audit target (`AUDIT`, shared with
`envs.gui_browser`) and the spec `ENV`.
Does not own: the page itself (`envs.gui_app`), tool-call parsing and errors (`envs.base.ToolEnv`).

Reward: 1.0 when the *saved* settings equal the goal exactly (the initial settings with the asked
changes), else 0.0: unsaved edits count for nothing and touching an unrelated setting fails the
task. Weight-free metrics: `progress` (share of the asked changes saved), `unrelated_changes`,
`unsaved_changes`, `actions` (well-formed calls of the four tools that reached the page) and
`invalid_actions` (those the page refused: an unknown or hidden element, the wrong action for it, a
disabled control); their ratio is the invalid-action rate. The episode ends when the model answers
without a tool call (e.g. "done"). Turn rewards, off unless the task's `turn_rewards` column is true
(`load_tasks(..., turn_rewards=True)`, `rollout.env_args`): each turn is paid for what it did to the
page (`GuiEnv.step`); the state a turn starts from is the page's (`GuiEnv.state_key`).

Splits: a task lands in "eval" when a hash of its settings and changes says so, else in "train";
so the two splits never share a task, whatever the seeds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import random
import re
from collections.abc import Sequence
from typing import Any, Literal

from agent_rl.core.audit_target import AuditTarget, Target
from agent_rl.core.env import Task
from agent_rl.core.registry import EnvSpec
from agent_rl.core.types import Message, Reward, ToolCall
from agent_rl.envs.base import TURN_PENALTY, StepResult, ToolEnv, turn_rewards_on, with_turn_rewards
from agent_rl.envs.gui_app import (
    BY_NAME,
    CONTROLS,
    NOTHING_TO_SAVE,
    SAVE,
    VISIBLE_ROWS,
    ActionError,
    Control,
    SettingsApp,
    Value,
    value_problem,
)
from agent_rl.tools.base import ToolError

SYSTEM = ("You operate a settings page with the click, type, select and scroll tools. Each tool returns the "
          "page's updated accessibility tree. Only saved changes count. When the task is complete, reply "
          "done without calling a tool.")
NAMES = ("Ada", "Alex", "Jordan", "Kim", "Lee", "Mia", "Noor", "Omar", "Robin", "Sam")
SPLITS = ("train", "eval")


# -- tasks ------------------------------------------------------------------------------------
def _phrase(name: str, value: Value) -> str:
    role = BY_NAME[name].role
    if role == "switch":
        return f"turn {'on' if value else 'off'} {name.lower()}"
    if role == "checkbox":
        return f"{'grant' if value else 'revoke'} the {name} permission"
    if role == "textbox":
        return f"change the {name.lower()} to {json.dumps(value)}"
    return f"set the {name.lower()} to {value}"


def instruction(changes: dict[str, Value]) -> str:
    """'Turn on dark mode, set the font size to 16 and grant the Camera permission, then save.'"""
    parts = [_phrase(c.name, changes[c.name]) for c in CONTROLS if c.name in changes]
    text = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return text[0].upper() + text[1:] + ", then save."


def _unreachable(initial: dict[str, Value], changes: dict[str, Value]) -> str | None:
    if "Notification sound" in changes and not {**initial, **changes}["Notifications"]:
        return "'Notification sound' cannot change while 'Notifications' stays off (the dropdown is disabled)"
    return None


def _draw(rng: random.Random, level: int) -> tuple[dict[str, Value], dict[str, Value]]:
    """Random settings and `level` changes. Level 1: one setting on screen; level 2: a list row below
    the fold and a page setting; level 3: those two and any third one."""
    initial: dict[str, Value] = {c.name: rng.random() < 0.5 if c.role in ("switch", "checkbox")
                                 else rng.choice(c.options or NAMES) for c in CONTROLS}
    page = [c for c in CONTROLS if c.row is None]
    in_view = [c for c in CONTROLS if c.row is None or c.row < VISIBLE_ROWS]
    below = [c for c in CONTROLS if c.row is not None and c.row >= VISIBLE_ROWS]
    while True:
        picked: list[Control] = [rng.choice(in_view)] if level == 1 else \
            [rng.choice(below), rng.choice(page), *([rng.choice(CONTROLS)] if level == 3 else [])]
        if len({c.name for c in picked}) < level:
            continue
        changes: dict[str, Value] = {}
        for c in picked:
            old = initial[c.name]
            changes[c.name] = (not old) if isinstance(old, bool) else rng.choice(
                [v for v in (c.options or NAMES) if v != old])
        if _unreachable(initial, changes) is None:
            return initial, changes


def _split_of(initial: dict[str, Value], changes: dict[str, Value]) -> str:
    key = json.dumps([initial, changes], sort_keys=True).encode()
    return "eval" if hashlib.blake2b(key, digest_size=4).digest()[0] % 4 == 0 else "train"


def load_tasks(n: int, seed: int = 0, split: str = "train", levels: Sequence[int] = (1, 2, 3),
               turn_rewards: bool = False) -> list[Task]:
    """`n` tasks of `split`, cycling through `levels` (e.g. [1, 2]); deterministic per (seed, split, levels).
    `turn_rewards`: each turn is paid for what it did to the page (`GuiEnv.step`)."""
    if split not in SPLITS:
        raise ValueError(f"gui tasks have splits {', '.join(SPLITS)} (got {split!r})")
    if not levels or any(lv not in (1, 2, 3) for lv in levels):
        raise ValueError(f"gui task levels must be a non-empty list of 1, 2 and 3 (got {list(levels)!r})")
    rng = random.Random(seed)
    rows: list[Task] = []
    while len(rows) < n:
        level = levels[len(rows) % len(levels)]
        initial, changes = _draw(rng, level)
        layout = rng.randrange(2**31)
        if _split_of(initial, changes) == split:
            rows.append({"id": f"gui-{split}-{seed}-{len(rows)}", "level": level, "instruction": instruction(changes),
                         "initial": initial, "changes": changes, "layout": layout})
    return with_turn_rewards(rows, turn_rewards)


def check_task(task: Any) -> Task:
    """The row itself, or ValueError naming the row and the column that is wrong."""
    if not isinstance(task, dict):
        raise ValueError(f"gui task must be a dict (got {type(task).__name__})")
    row = task.get("id", "?")

    def bad(column: str, why: str) -> ValueError:
        return ValueError(f"gui task {row!r}: column {column!r}: {why}")

    for column, kind in (("id", str), ("instruction", str), ("initial", dict), ("changes", dict), ("layout", int)):
        if column not in task:
            raise bad(column, "missing")
        if not isinstance(task[column], kind) or isinstance(task[column], bool):
            raise bad(column, f"must be {kind.__name__} (got {type(task[column]).__name__})")
    initial, changes = task["initial"], task["changes"]
    missing = [name for name in BY_NAME if name not in initial]
    if missing:
        raise bad("initial", f"no value for {missing[0]!r}")
    for column, values in (("initial", initial), ("changes", changes)):
        for name, value in values.items():
            if (problem := value_problem(name, value)) is not None:
                raise bad(column, problem)
    if not changes:
        raise bad("changes", "no change asked for")
    same = [name for name, value in changes.items() if initial[name] == value]
    if same:
        raise bad("changes", f"{same[0]!r} already has the value {changes[same[0]]!r}")
    if (problem := _unreachable(initial, changes)) is not None:
        raise bad("changes", problem)
    return task


# -- the episode --------------------------------------------------------------------------------
class GuiEnv(ToolEnv):
    """One settings task on a fresh page; tools act on it, the reward reads what was saved.

    `self.app` is the page: a `SettingsApp` here, a browser page in `envs.gui_browser`, whose
    methods are coroutines; `_page` calls either.
    """

    def __init__(self, task: Task):
        self.task = check_task(task)
        self.app: Any = SettingsApp(task["initial"], task["layout"])
        self.goal = {**task["initial"], **task["changes"]}
        self.actions = self.invalid_actions = self.idle_saves = 0
        self.turn_rewards = turn_rewards_on(task)
        super().__init__([self.click, self.type, self.select, self.scroll])

    async def _page(self, method: str, *args: str) -> Any:
        out = getattr(self.app, method)(*args)
        return await out if inspect.isawaitable(out) else out

    async def _act(self, method: str, *args: str) -> str:
        self.actions += 1
        try:
            done = await self._page(method, *args)
        except ActionError as e:
            self.invalid_actions += 1
            self.idle_saves += NOTHING_TO_SAVE in str(e)
            raise ToolError(str(e)) from None
        return f"{done}\n{await self._page('tree')}"

    async def state_key(self) -> str:
        """The page's state: what is saved, what is drafted, and the tree (where the list is scrolled)."""
        saved, draft = await self._page("values")
        page = json.dumps([saved, draft, await self._page("tree")], sort_keys=True)
        return hashlib.blake2b(page.encode(), digest_size=8).hexdigest()

    async def _potential(self) -> float:
        """0.1 per asked setting once the saved settings equal the goal; before that -0.1 per setting outside
        the task saved away from its initial value (so never above 0 while the task is unsolved)."""
        saved, _ = await self._page("values")
        if saved == self.goal:
            return -TURN_PENALTY * len(self.task["changes"])
        return TURN_PENALTY * sum(saved[k] != self.task["initial"][k] for k in BY_NAME if k not in self.task["changes"])

    async def step(self, reply: Message, turn: int) -> StepResult:
        """With turn rewards on (the task's `turn_rewards` column) the turn is paid, as parts: `saved`, the
        change its Saves made to `_potential` (potential-based: it telescopes, so saving, undoing and saving
        again earns nothing, and no unsolved page is worth more than the start); `idle_save`, -0.1 per Save
        clicked with nothing to save; `refused`, -0.1 per other action the page refused; `bad_call`, -0.1 per
        call that never reached the page (unreadable, unknown tool, invalid arguments)."""
        if not self.turn_rewards:
            return await super().step(reply, turn)
        before, counts = await self._potential(), (self.invalid_actions, self.idle_saves)
        result = await super().step(reply, turn)
        refused, idle = self.invalid_actions - counts[0], self.idle_saves - counts[1]
        failed = sum(not r.ok for r in result.tool_calls)
        parts = {"saved": await self._potential() - before, "idle_save": TURN_PENALTY * idle,
                 "refused": TURN_PENALTY * (refused - idle), "bad_call": TURN_PENALTY * (failed - refused)}
        parts = {k: v + 0.0 for k, v in parts.items()}  # -0.0 (nothing of the kind) as 0.0
        return dataclasses.replace(result, reward=Reward(sum(parts.values()), parts))

    async def click(self, element: str) -> str:
        """Click an element: toggles a switch or checkbox, presses a button.

        Args:
            element: The element id shown in [brackets] in the tree, e.g. "e12".
        """
        return await self._act("click", element)

    async def type(self, element: str, text: str) -> str:
        """Replace the text of a text field.

        Args:
            element: The text field's id from the tree, e.g. "e12".
            text: The new text.
        """
        return await self._act("type", element, text)

    async def select(self, element: str, option: str) -> str:
        """Choose one option of a dropdown (combobox).

        Args:
            element: The dropdown's id from the tree, e.g. "e12".
            option: One of the options the tree lists for it.
        """
        return await self._act("select", element, option)

    async def scroll(self, direction: Literal["up", "down"]) -> str:
        """Scroll the list of app permissions by one screen (four rows).

        Args:
            direction: "up" or "down".
        """
        return await self._act("scroll", direction)

    async def initial_messages(self) -> list[Message]:
        user = f"{self.task['instruction']}\n\nThe page (use the element ids in brackets):\n{await self._page('tree')}"
        return [Message("system", SYSTEM), Message("user", user)]

    async def reward(self, messages: Sequence[Message]) -> Reward:
        saved, draft = await self._page("values")
        initial, changes = self.task["initial"], self.task["changes"]
        solved = float(saved == self.goal)
        return Reward(solved, {
            "solved": solved,
            "progress": sum(saved[k] == v for k, v in changes.items()) / len(changes),
            "unrelated_changes": float(sum(saved[k] != initial[k] for k in BY_NAME if k not in changes)),
            "unsaved_changes": float(sum(draft[k] != saved[k] for k in BY_NAME)),
            "actions": float(self.actions),
            "invalid_actions": float(self.invalid_actions),
        })


def make_env(task: Task) -> GuiEnv:
    return GuiEnv(task)


# -- the scripted demonstration ----------------------------------------------------------------
_ELEMENT = re.compile(r'^\s*(\w+) "([^"]+)" \[(e\d+)\](.*)$', re.MULTILINE)


def _read(tree_text: str) -> dict[str, tuple[str, str]]:
    """name -> (element id, the rest of its line) for every element line, the last one winning."""
    return {m.group(2): (m.group(3), m.group(4)) for m in _ELEMENT.finditer(tree_text)}


def _shows(rest: str, value: Value) -> bool:
    if isinstance(value, bool):
        return rest.split()[0] == ("checked" if value else "unchecked")
    return f"value={json.dumps(value)}" in rest


def _act(name: str, **arguments: Any) -> Message:
    return Message("assistant", "", (ToolCall(name, arguments),))


def solve(task: Task, messages: Sequence[Message], direct: bool = False) -> Message:
    """The next reply of a scripted agent that reads the trees its messages show: one action per turn
    (scroll until the row is on screen, then click / select / type it), Save, then "done". A setting
    outside the task that the trees show changed (a slip, see `mistake`) is set back the same way.

    What it knows of a setting is the last tree line that showed it (a value only changes when the
    agent acts on a visible element, and the tree returned then shows it). `direct=True` raises
    ValueError: a settings task cannot be done by answering, only by acting on the page.
    """
    if direct:
        raise ValueError("gui tasks have no direct answer: the settings change only through the tools")
    check_task(task)
    trees = [m.content for m in messages if m.role in ("user", "tool") and 'page "Settings"' in m.content]
    if not trees:
        raise ValueError("no page tree in the conversation: the gui task's user message shows one")
    known = _read("\n".join(trees))
    latest = trees[-1]
    on_screen = _read(latest[latest.rfind('page "Settings"'):])
    top_row = min((row for n in on_screen if n in BY_NAME and (row := BY_NAME[n].row) is not None), default=0)
    goal = {**task["initial"], **task["changes"]}
    for control in CONTROLS:
        if control.name not in task["changes"] and control.name not in known:
            continue  # never on screen, so never touched
        want = goal[control.name]
        if control.name in known and _shows(known[control.name][1], want):
            continue
        if control.name not in on_screen:  # a row of the list: the controls above it are always on screen
            assert control.row is not None
            return _act("scroll", direction="down" if control.row > top_row else "up")
        element = on_screen[control.name][0]
        if control.role == "combobox":
            return _act("select", element=element, option=want)
        if control.role == "textbox":
            return _act("type", element=element, text=want)
        return _act("click", element=element)
    element, rest = on_screen[SAVE]
    if "disabled" not in rest.split():
        return _act("click", element=element)
    return Message("assistant", "done")


def mistake(task: Task, messages: Sequence[Message], rng: random.Random) -> Message | None:
    """A slip of a careless agent that `solve` then repairs, drawn with `rng` from those that fit here:
    click an unrelated switch or checkbox on screen (solve sets it back), use the wrong tool on the
    element solve would act on next (the page refuses: "cannot click e12 (combobox ...); use select"),
    or click an element id the page does not have. None when the solver's next move is "done" and
    no unrelated control is on screen."""
    check_task(task)
    trees = [m.content for m in messages if m.role in ("user", "tool") and 'page "Settings"' in m.content]
    if not trees:
        return None
    latest = trees[-1]
    on_screen = _read(latest[latest.rfind('page "Settings"'):])
    slips: list[Message] = []
    unrelated = [eid for name, (eid, rest) in on_screen.items() if name in BY_NAME and name not in task["changes"]
                 and BY_NAME[name].role in ("switch", "checkbox") and "disabled" not in rest.split()]
    if unrelated:
        slips.append(_act("click", element=rng.choice(sorted(unrelated))))
    nxt = solve(task, messages).tool_calls
    if nxt and nxt[0].name in ("click", "select", "type") and nxt[0].arguments["element"] != on_screen[SAVE][0]:
        element = nxt[0].arguments["element"]
        slips.append(_act("click", element=element) if nxt[0].name != "click" else
                     _act("select", element=element, option=rng.choice(["on", "yes", "checked"])))
    if nxt:
        used = {eid for eid, _ in on_screen.values()}
        slips.append(_act("click", element=rng.choice([f"e{k}" for k in range(10, 100) if f"e{k}" not in used])))
    return rng.choice(slips) if slips else None


def audit_target(task: Task, tasks: Sequence[Task]) -> Target:
    """The task as the reward audit's hacks see it: the instruction; no answer to state (the settings
    are the answer), so the GUI hacks claim the task done, or act halfway; scrolling is the action
    that is always accepted and changes nothing."""
    scrolls = (ToolCall("scroll", {"direction": "down"}), ToolCall("scroll", {"direction": "up"}))
    return Target(task, str(task["instruction"]), probes=scrolls)


# an empty reply, the instruction echoed, the hacks that claim a GUI task done without doing it, and those
# that collect its turn rewards without solving it
AUDIT = AuditTarget(("empty_reply", "echo_question", "gui", "turn"), audit_target)
ENV = EnvSpec("gui", make_env, load_tasks, solve=solve, mistake=mistake, audit=AUDIT)
