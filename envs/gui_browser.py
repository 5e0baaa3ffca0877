"""The GUI environment in a real browser: the same settings page as HTML, driven in headless Chromium.

Owns: the page as HTML plus a small script (`page_html`, built from a `SettingsApp`: same controls,
element ids and values), `BrowserApp` (the four actions through Playwright; the tree built from
Chromium's accessibility snapshot), `BrowserGuiEnv` and the spec `ENV`. The tasks, reward, scripted
solver and audit target are `envs.gui`'s, so `--env gui_browser` plays the same tasks as `--env gui`.
Does not own: the page's wording and rules (`envs.gui_app`), tasks and reward (`envs.gui`).

Needs Debian's Chromium and the playwright package (no `playwright install`: no browser download):

    apt-get install -y chromium        # or set AGENT_RL_CHROMIUM to another Chromium binary
    pip install playwright

What comes from the browser: roles, names, states, values and which list rows exist come from
Playwright's ARIA snapshot of the page; the list is virtualised (only the rows on screen are in the
DOM, as in most real apps) and scrolls on mouse-wheel events. The snapshot carries no element ids,
so each element's DOM id is attached by its accessible name (names are unique on this page).
Each episode launches its own Chromium (the slowest part of its start: docs/performance.md#smaller-measurements)
and closes it on exit.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
from typing import Any

import yaml

from agent_rl.core.env import Task
from agent_rl.core.registry import EnvSpec
from agent_rl.envs.gui import AUDIT, GuiEnv, load_tasks, solve
from agent_rl.envs.gui_app import (
    APPS,
    CONTROLS,
    LIST_NAME,
    SAVE,
    VISIBLE_ROWS,
    ActionError,
    SettingsApp,
    element_line,
    now_text,
    option_of,
    refusal,
    saved_text,
    scrolled,
    unknown,
    value_problem,
)

URL = "http://settings.test/"  # never on the network: the page's route answers it from memory
ACTION_TIMEOUT_MS = 5_000
_SCRIPT = """
const S = %s;
const $ = id => document.getElementById(id);
let saved = {...S.values}, draft = {...S.values}, first = 0;  // first visible row (`top` is taken)
const unsaved = () => Object.keys(draft).filter(k => draft[k] !== saved[k]).length;
function rows() {
  $("list").replaceChildren(...S.apps.slice(first, first + S.visible).map(name => {
    const li = document.createElement("li"), label = document.createElement("label");
    const box = Object.assign(document.createElement("input"), {type: "checkbox", id: S.ids[name]});
    label.append(box, " " + name); li.append(label); return li;
  }));
}
function render() {
  for (const [name, id] of Object.entries(S.ids)) {
    const el = $(id);
    if (!el || name === "Save") continue;
    if (el.type === "checkbox") el.checked = draft[name]; else if (el.value !== draft[name]) el.value = draft[name];
  }
  $(S.ids["Notification sound"]).disabled = !draft["Notifications"];
  const n = unsaved(), last = Math.min(first + S.visible, S.apps.length), more = [];
  $("status").textContent = n ? n + " unsaved change" + (n === 1 ? "" : "s") : "all changes saved";
  $(S.ids.Save).disabled = n === 0;
  if (first > 0) more.push("above");
  if (last < S.apps.length) more.push("below");
  $("rows").textContent = `rows ${first + 1}-${last} of ${S.apps.length}`
    + (more.length ? ", more " + more.join(" and ") : "");
}
const edit = e => { const name = S.names[e.target.id]; if (!name || name === "Save") return;
  draft[name] = e.target.type === "checkbox" ? e.target.checked : e.target.value; render(); };
document.addEventListener("change", edit);
document.addEventListener("input", edit);
$(S.ids.Save).addEventListener("click", () => { saved = {...draft}; render(); });
$("list").addEventListener("wheel", e => {
  e.preventDefault();
  first = Math.max(0, Math.min(first + Math.sign(e.deltaY) * S.visible, S.apps.length - S.visible));
  rows(); render();
}, {passive: false});
window.app = {state: () => ({saved, draft, top: first, unsaved: unsaved()})};
rows(); render();
"""


def page_html(app: SettingsApp) -> str:
    """The settings page as one HTML document with the app's element ids and draft values."""
    parts = []
    for c in CONTROLS:
        if c.row is not None:
            continue
        eid, name = app.ids[c.name], html.escape(c.name)
        if c.role == "switch":
            parts.append(f'<label><input type="checkbox" role="switch" id="{eid}"> {name}</label>')
        elif c.role == "combobox":
            options = "".join(f"<option>{html.escape(o)}</option>" for o in c.options)
            parts.append(f'<label for="{eid}">{name}</label><select id="{eid}">{options}</select>')
        else:
            parts.append(f'<label for="{eid}">{name}</label><input id="{eid}">')
    state = {"ids": app.ids, "names": app.names, "values": app.draft, "apps": APPS, "visible": VISIBLE_ROWS}
    script = _SCRIPT % json.dumps(state).replace("</", "<\\/")
    return ("<!doctype html><html><head><title>Settings</title></head><body><main aria-label=\"Settings\">"
            "<h1>Settings</h1><p role=\"status\" id=\"status\"></p>" + "".join(f"<div>{p}</div>" for p in parts)
            + f'<section aria-label="{html.escape(LIST_NAME)}"><p id="rows"></p>'
            f'<ul id="list" aria-label="{html.escape(LIST_NAME)}"></ul></section>'
            f'<button id="{app.ids[SAVE]}">{SAVE}</button></main><script>{script}</script></body></html>')


_KEY = re.compile(r'^(\w+)(?: "((?:[^"\\]|\\.)*)")?(.*)$')
_ELEMENT_ROLES = ("switch", "checkbox", "combobox", "textbox", "button")


def tree_from_snapshot(snapshot: str, ids: dict[str, str]) -> str:
    """Playwright's ARIA snapshot (YAML) -> the tree text `SettingsApp.tree()` writes."""
    lines: list[str] = []

    def parse(node: Any) -> tuple[str, str, str, Any]:
        key, body = (node, None) if isinstance(node, str) else next(iter(node.items()))
        m = _KEY.match(key)
        if m is None:
            raise ValueError(f"unexpected accessibility snapshot entry {key!r}")
        name = json.loads(f'"{m.group(2)}"') if m.group(2) is not None else ""
        return m.group(1), name, m.group(3), body

    def walk(nodes: Any, indent: str, page: str) -> None:
        for node in nodes or []:
            role, name, attrs, body = parse(node)
            kids = body if isinstance(body, list) else []
            if role == "main":
                walk(kids, indent, name)
            elif role == "status":
                lines.append(f'page "{page}" ({body})')
            elif role == "region":
                rows = next((b for r, _, _, b in map(parse, kids) if r == "paragraph"), "")
                lines.append(f'list "{name}" {rows}')
                walk(kids, indent + "  ", page)
            elif role in ("list", "listitem", "generic"):
                walk(kids, indent, page)
            elif role in _ELEMENT_ROLES:
                value: bool | str | None = None
                if role in ("switch", "checkbox"):
                    value = "[checked]" in attrs
                elif role == "combobox":
                    value = next((n for _, n, a, _ in map(parse, kids) if "[selected]" in a), "")
                elif role == "textbox":
                    value = body if isinstance(body, str) else ""
                lines.append(indent + element_line(role, name, ids[name], value, "[disabled]" in attrs))

    walk(yaml.load(snapshot, Loader=yaml.BaseLoader), "", "")
    return "\n".join(lines)


class BrowserApp:
    """The settings page in headless Chromium, with the methods of `SettingsApp` as coroutines."""

    def __init__(self, ids: dict[str, str], playwright: Any, browser: Any, page: Any):
        self.ids, self.names = ids, {eid: name for name, eid in ids.items()}
        self._playwright, self._browser, self.page = playwright, browser, page

    @classmethod
    async def open(cls, model: SettingsApp) -> BrowserApp:
        """Launch Chromium and load `model`'s page (same ids and values)."""
        try:
            from playwright.async_api import async_playwright
        except ImportError:
            raise RuntimeError("the browser GUI environment needs the playwright package: "
                               "pip install playwright") from None
        chromium = os.environ.get("AGENT_RL_CHROMIUM") or shutil.which("chromium")
        if not chromium or not os.path.isfile(chromium):
            raise RuntimeError(f"no Chromium found ({chromium or 'chromium not on PATH'}): apt-get install -y "
                               "chromium, or set AGENT_RL_CHROMIUM to a Chromium binary")
        body = page_html(model)
        playwright = await async_playwright().start()
        try:
            browser = await playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = await browser.new_page()
            page.set_default_timeout(ACTION_TIMEOUT_MS)
            await page.route(URL, lambda route: route.fulfill(body=body, content_type="text/html"))
            await page.goto(URL)
        except BaseException:
            await playwright.stop()
            raise
        return cls(dict(model.ids), playwright, browser, page)

    async def close(self) -> None:
        try:
            await self._browser.close()
        finally:
            await self._playwright.stop()

    async def _state(self) -> dict[str, Any]:
        return await self.page.evaluate("window.app.state()")

    async def values(self) -> tuple[dict[str, Any], dict[str, Any]]:
        state = await self._state()
        return state["saved"], state["draft"]

    async def tree(self) -> str:
        return tree_from_snapshot(await self.page.locator("main").aria_snapshot(), self.ids)

    async def _target(self, element: str, action: str, roles: tuple[str, ...]) -> tuple[str, Any]:
        name = self.names.get(element.strip())
        if name is None:
            raise unknown(element)
        locator = self.page.locator(f"#{self.ids[name]}")
        visible = await locator.count() > 0  # rows scrolled away are not in the DOM
        refused = refusal(name, self.ids[name], action, roles, visible, visible and await locator.is_disabled())
        if refused:
            raise refused
        return name, locator

    async def click(self, element: str) -> str:
        name, locator = await self._target(element, "click", ("switch", "checkbox", "button"))
        if name == SAVE:
            count = (await self._state())["unsaved"]
            await _browser_step(locator.click())
            return saved_text(count)
        await _browser_step(locator.click())
        return now_text(name, await locator.is_checked())

    async def type(self, element: str, text: str) -> str:
        name, locator = await self._target(element, "type into", ("textbox",))
        if (problem := value_problem(name, text)) is not None:
            raise ActionError(problem)
        await _browser_step(locator.fill(text))
        return now_text(name, await locator.input_value())

    async def select(self, element: str, option: str) -> str:
        name, locator = await self._target(element, "select an option of", ("combobox",))
        chosen = option_of(name, option)
        await _browser_step(locator.select_option(chosen))
        return now_text(name, chosen)

    async def scroll(self, direction: str) -> str:
        top = (await self._state())["top"]
        new_top, said = scrolled(top, direction)
        if new_top != top:
            await _browser_step(self.page.locator("#list").hover())
            await self.page.mouse.wheel(0, 100 if direction == "down" else -100)
            await _browser_step(self.page.wait_for_function("top => window.app.state().top === top", arg=new_top))
        return said


async def _browser_step(step: Any) -> Any:
    """Await a Playwright call; its multi-line errors become a one-line ActionError."""
    from playwright.async_api import Error as PlaywrightError

    try:
        return await step
    except PlaywrightError as e:
        raise ActionError(f"the browser refused: {str(e).splitlines()[0]}") from None


class BrowserGuiEnv(GuiEnv):
    """`GuiEnv` on the HTML page in Chromium; the browser starts on enter and closes on exit."""

    async def __aenter__(self) -> BrowserGuiEnv:
        self.app = await BrowserApp.open(self.app)
        return self

    async def close(self) -> None:
        if isinstance(self.app, BrowserApp):
            await self.app.close()


def make_env(task: Task) -> BrowserGuiEnv:
    return BrowserGuiEnv(task)


ENV = EnvSpec("gui_browser", make_env, load_tasks, solve=solve, audit=AUDIT)


__all__ = ["BrowserApp", "BrowserGuiEnv", "load_tasks", "make_env", "page_html", "solve", "tree_from_snapshot"]
