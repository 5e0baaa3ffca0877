"""The GUI-agent environment: the settings page, its tasks, tools, reward and scripted solver."""

import importlib.util
import json
import os
import shutil

import pytest
from helpers import call_text, play_episode

from agent_rl.core.types import Message, StopReason
from agent_rl.envs.gui import GuiEnv, check_task, load_tasks, make_env, mistake, solve
from agent_rl.envs.gui_app import APPS, BY_NAME, CONTROLS, VISIBLE_ROWS, ActionError, SettingsApp
from agent_rl.rollout.runner import EpisodeLimits, run_episode

LIMITS = EpisodeLimits(max_turns=12, max_total_tokens=8192)
# every switch and checkbox off, the first option of each dropdown, display name "Sam"
PLAIN = {c.name: False if c.role in ("switch", "checkbox") else (c.options[0] if c.options else "Sam")
         for c in CONTROLS}
# layout 7 gives these element ids (see the tree below)
TASK = {"id": "t", "level": 3, "instruction": "Turn on dark mode, set the font size to 16 and grant the Motion "
        "permission, then save.", "initial": PLAIN, "changes": {"Dark mode": True, "Font size": "16", "Motion": True},
        "layout": 7}

TREE = """\
page "Settings" (all changes saved)
switch "Dark mode" [e51] unchecked
switch "Notifications" [e29] unchecked
combobox "Notification sound" [e60] value="Bell" options=Bell|Chime|Marimba|Pulse disabled
combobox "Font size" [e93] value="12" options=12|14|16|18|20
combobox "Language" [e16] value="English" options=English|French|German|Italian|Spanish
textbox "Display name" [e19] value="Sam"
list "App permissions" rows 1-4 of 12, more below
  checkbox "Bluetooth" [e78] unchecked
  checkbox "Calendar" [e22] unchecked
  checkbox "Camera" [e56] unchecked
  checkbox "Contacts" [e84] unchecked
button "Save" [e40] disabled"""


# -- the page ----------------------------------------------------------------------------------
def test_tree_shows_roles_states_ids_and_only_the_visible_rows():
    app = SettingsApp(PLAIN, layout=7)
    assert app.tree() == TREE
    assert app.scroll("down") == "Scrolled down." and app.scroll("down") == "Scrolled down."
    assert app.scroll("down") == "The list is already at the bottom."
    tree = app.tree()
    assert 'list "App permissions" rows 9-12 of 12, more above' in tree
    assert [line.split('"')[1] for line in tree.splitlines() if line.startswith("  ")] == list(APPS[8:])
    assert SettingsApp(PLAIN, layout=8).ids != app.ids  # ids must be read from the tree


def test_edits_stay_drafts_until_save():
    app = SettingsApp(PLAIN, layout=7)
    assert app.click("e51") == "Dark mode is now checked."
    assert app.select("e93", "16") == 'Font size is now "16".'
    assert app.type("e19", "Robin") == 'Display name is now "Robin".'
    assert app.saved == PLAIN and len(app.unsaved) == 3
    assert app.tree().splitlines()[0] == 'page "Settings" (3 unsaved changes)'
    assert app.tree().splitlines()[-1] == 'button "Save" [e40]'
    assert app.click("e40") == "Saved 3 changes."
    assert app.saved == {**PLAIN, "Dark mode": True, "Font size": "16", "Display name": "Robin"}
    assert app.unsaved == [] and app.tree().splitlines()[-1] == 'button "Save" [e40] disabled'


@pytest.mark.parametrize("action, args, message", [
    ("click", ("e11",), "no element 'e11' on the page; use an id in [brackets] from the tree"),
    ("click", ("e40",), "e40 (Save) is disabled: nothing to save"),
    ("select", ("e60", "Chime"), "e60 (Notification sound) is disabled: turn on Notifications first"),
    ("type", ("e40", "hi"), "cannot type into e40 (button 'Save'); use click"),
    ("type", ("e51", "on"), "cannot type into e51 (switch 'Dark mode'); use click"),
    ("click", ("e93",), "cannot click e93 (combobox 'Font size'); use select"),
    ("select", ("e93", "15"), "Font size has no option '15'; options: 12, 14, 16, 18, 20"),
    ("type", ("e19", ""), "'Display name' must be 1 to 40 characters (got 0)"),
    ("click", ("e21",), "e21 (Motion) is scrolled out of view; scroll the list to it first"),
    ("scroll", ("left",), "cannot scroll 'left'; scroll up or down"),
])
def test_refused_actions_are_one_line_errors_and_change_nothing(action, args, message):
    app = SettingsApp(PLAIN, layout=7)
    with pytest.raises(ActionError) as refused:
        getattr(app, action)(*args)
    assert str(refused.value) == message
    assert app.tree() == TREE


def test_notification_sound_is_enabled_by_notifications():
    app = SettingsApp(PLAIN, layout=7)
    app.click("e29")
    assert app.select("e60", "chime") == 'Notification sound is now "Chime".'  # options match case-blind


# -- tasks --------------------------------------------------------------------------------------
def test_tasks_are_deterministic_levelled_and_the_splits_disjoint():
    train = load_tasks(90, seed=3)
    assert train == load_tasks(90, seed=3) and train != load_tasks(90, seed=4)
    evals = load_tasks(90, seed=3, split="eval")
    key = lambda t: json.dumps([t["initial"], t["changes"]], sort_keys=True)  # noqa: E731
    assert not {key(t) for t in train} & {key(t) for t in evals}
    assert len({t["id"] for t in train + evals}) == 180
    for task in train + evals:
        check_task(task)
        assert len(task["changes"]) == task["level"]
        rows = [BY_NAME[n].row for n in task["changes"] if BY_NAME[n].row is not None]
        needs_scroll = any(r >= VISIBLE_ROWS for r in rows)
        assert needs_scroll == (task["level"] > 1)
    with pytest.raises(ValueError, match="gui tasks have splits train, eval"):
        load_tasks(1, split="test")


def test_levels_pick_which_tasks_cycle():
    tasks = load_tasks(12, seed=3, levels=[1, 2])
    assert [t["level"] for t in tasks] == [1, 2] * 6 and all(len(t["changes"]) == t["level"] for t in tasks)
    assert [t["level"] for t in load_tasks(3, seed=3, levels=[3])] == [3, 3, 3]
    assert load_tasks(9, seed=3, levels=(1, 2, 3)) == load_tasks(9, seed=3)  # the default
    for bad in ([], [0], [1, 4]):
        with pytest.raises(ValueError, match="gui task levels must be a non-empty list of 1, 2 and 3"):
            load_tasks(2, levels=bad)


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("changes"), "gui task 't': column 'changes': missing"),
    (lambda t: t.update(layout="7"), "gui task 't': column 'layout': must be int"),
    (lambda t: t["initial"].pop("Music"), "gui task 't': column 'initial': no value for 'Music'"),
    (lambda t: t["changes"].update({"Font size": "15"}),
     "gui task 't': column 'changes': 'Font size' must be one of 12, 14, 16, 18, 20"),
    (lambda t: t["changes"].update({"Volume": "3"}), "gui task 't': column 'changes': unknown setting 'Volume'"),
    (lambda t: t["changes"].update({"Camera": False}),
     "gui task 't': column 'changes': 'Camera' already has the value False"),
    (lambda t: t["changes"].update({"Notification sound": "Pulse"}),
     "gui task 't': column 'changes': 'Notification sound' cannot change while 'Notifications' stays off"),
])
def test_malformed_row_names_the_row_and_column(change, message):
    task = json.loads(json.dumps(TASK))
    change(task)
    with pytest.raises(ValueError, match=message):
        make_env(task)


# -- episodes -----------------------------------------------------------------------------------
async def gui_episode(scripted, renderer, task, script):
    """The episode of `task` whose replies are `script(messages)`: text, or a Message like the solver's."""
    return await play_episode(GuiEnv(task), scripted(script, on_messages=True), renderer, LIMITS, task["id"])


def saves(reply) -> bool:
    return any(c.arguments.get("element") == "e40" for c in reply.tool_calls)


async def test_scripted_demonstration_earns_full_reward(scripted, renderer):
    traj = await gui_episode(scripted, renderer, TASK, lambda m: solve(TASK, m, False))
    replies = [m.content for m in traj.messages if m.role == "assistant"]
    assert replies == [call_text("click", element="e51"), call_text("select", element="e93", option="16"),
                       call_text("scroll", direction="down"), call_text("scroll", direction="down"),
                       call_text("click", element="e21"), call_text("click", element="e40"), "done"]
    assert traj.reward == 1.0 and traj.stop_reason is StopReason.NO_TOOL_CALL
    assert traj.reward_parts == {"solved": 1.0, "progress": 1.0, "unrelated_changes": 0.0, "unsaved_changes": 0.0,
                                 "actions": 6.0, "invalid_actions": 0.0}
    assert "Turn on dark mode" in traj.messages[1].content and TREE in traj.messages[1].content
    assert traj.messages[-2].content.startswith("Saved 3 changes.\npage \"Settings\" (all changes saved)")
    for task in load_tasks(6, seed=1) + load_tasks(3, seed=1, split="eval"):
        traj = await gui_episode(scripted, renderer, task, lambda m, task=task: solve(task, m, False))
        assert traj.reward == 1.0, (task["id"], traj.messages[-3:])


async def test_unsaved_or_unrelated_changes_earn_nothing(scripted, renderer):
    def unsaved(messages):  # does everything the solver does except pressing Save
        reply = solve(TASK, messages, False)
        return "done" if saves(reply) else reply

    traj = await gui_episode(scripted, renderer, TASK, unsaved)
    assert traj.reward == 0.0
    assert traj.reward_parts == {"solved": 0.0, "progress": 0.0, "unrelated_changes": 0.0, "unsaved_changes": 3.0,
                                 "actions": 5.0, "invalid_actions": 0.0}

    believes_robin = {**TASK, "initial": {**PLAIN, "Display name": "Robin"}}  # so the solver keeps the rename

    def also_renames(messages):  # the asked changes plus a new display name, all saved
        if not any("Display name is now" in m.content for m in messages):
            return call_text("type", element="e19", text="Robin")
        return solve(believes_robin, messages, False)

    traj = await gui_episode(scripted, renderer, TASK, also_renames)
    assert traj.reward == 0.0
    assert traj.reward_parts == {"solved": 0.0, "progress": 1.0, "unrelated_changes": 1.0, "unsaved_changes": 0.0,
                                 "actions": 7.0, "invalid_actions": 0.0}
    traj = await gui_episode(scripted, renderer, TASK, lambda p: "done")
    assert traj.reward == 0.0 and traj.tool_calls == ()


async def test_malformed_calls_get_error_messages_and_the_episode_goes_on(scripted, renderer):
    mistakes = ['<tool_call>\n{"name": "click", "arguments": {"element": "e51"}\n</tool_call>',  # bad JSON
                call_text("tap", element="e51"),  # unknown tool
                call_text("scroll", direction="left"),  # argument outside the enum
                call_text("select", element="e93"),  # missing argument
                call_text("click", element="e40")]  # Save is disabled

    def script(messages):
        turn = sum(m.role == "assistant" for m in messages)
        return mistakes[turn] if turn < len(mistakes) else solve(TASK, messages, False)

    traj = await gui_episode(scripted, renderer, TASK, script)
    errors = [m.content for m in traj.messages if m.role == "tool"][:5]
    assert errors[0].startswith("Error: tool call 1: malformed JSON")
    assert errors[1] == "Error: unknown tool 'tap'; available tools: click, type, select, scroll"
    assert errors[2].startswith("Error: invalid arguments for scroll: direction: Input should be 'up' or 'down'")
    assert errors[3] == "Error: invalid arguments for select: option: Field required"
    assert errors[4] == "Error: e40 (Save) is disabled: nothing to save"
    assert [r.ok for r in traj.tool_calls][:6] == [False] * 5 + [True]
    assert traj.reward == 1.0
    # of the five, only the disabled Save reached the page: the others failed before (parse, tool, arguments)
    assert traj.reward_parts["invalid_actions"] == 1.0 and traj.reward_parts["actions"] == 1.0 + 6.0


async def test_slips_are_refused_or_set_back_and_the_task_is_still_solved(scripted, renderer):
    import random

    kinds = set()
    for task in [TASK, *load_tasks(12, seed=2)]:
        for at in range(3):  # a slip at the first, second or third turn
            rng = random.Random(f"{task['id']}-{at}")
            slipped = []

            def script(messages, task=task, at=at, rng=rng, slipped=slipped):
                if not slipped and sum(m.role == "assistant" for m in messages) >= at:
                    reply = mistake(task, messages, rng)
                    if reply is not None:
                        slipped.append(reply.tool_calls[0])
                        return reply
                return solve(task, messages, False)

            traj = await gui_episode(scripted, renderer, task, script)
            assert slipped and traj.reward == 1.0, (task["id"], at, [m.content for m in traj.messages[-4:]])
            kind = "refused" if traj.reward_parts["invalid_actions"] == 1.0 else "set back"
            assert traj.reward_parts["invalid_actions"] == (kind == "refused")
            kinds.add((kind, slipped[0].name))
    # the three slips: an unrelated toggle (set back later), the wrong tool or an unknown id (refused)
    assert {("set back", "click"), ("refused", "click"), ("refused", "select")} <= kinds


def test_a_slip_on_this_page():
    import random

    messages = [Message("system", "s"), Message("user", TASK["instruction"] + "\n" + TREE)]
    seen = {(c.name, json.dumps(c.arguments)) for k in range(40)
            for c in mistake(TASK, messages, random.Random(k)).tool_calls}
    unrelated = {"e29", "e78", "e22", "e56", "e84"}  # on screen, enabled, not in the task
    toggles = {a for n, a in seen if n == "click" and json.loads(a)["element"] in unrelated}
    wrong_tool = {a for n, a in seen if n == "select" and json.loads(a)["element"] == "e51"}  # Dark mode is clicked
    unknown_ids = {a for n, a in seen if n == "click" and json.loads(a)["element"] not in unrelated | {"e51"}}
    assert toggles and wrong_tool and unknown_ids
    assert all(json.loads(a)["element"] not in TREE for a in unknown_ids)
    assert len(seen) == len(toggles) + len(wrong_tool) + len(unknown_ids)
    assert mistake(TASK, [Message("user", "no page here")], random.Random(0)) is None


def test_direct_solving_is_refused_with_a_reason():
    with pytest.raises(ValueError, match="gui tasks have no direct answer"):
        solve(TASK, [], True)


# -- the same page in headless Chromium (envs.gui_browser) -------------------------------------
def _no_browser() -> str | None:
    if importlib.util.find_spec("playwright") is None:
        return "the playwright package is not installed (pip install playwright)"
    if not (os.environ.get("AGENT_RL_CHROMIUM") or shutil.which("chromium")):
        return "no Chromium binary (apt-get install -y chromium, or set AGENT_RL_CHROMIUM)"
    return None


needs_browser = pytest.mark.skipif(_no_browser() is not None, reason=str(_no_browser()))


async def test_browser_env_without_a_browser_says_what_to_install(monkeypatch):
    from agent_rl.envs.gui_browser import BrowserGuiEnv

    monkeypatch.setenv("AGENT_RL_CHROMIUM", "/nonexistent/chromium")
    with pytest.raises(RuntimeError, match="pip install playwright|apt-get install -y chromium"):
        async with BrowserGuiEnv(TASK):
            pass


@needs_browser
async def test_browser_page_shows_the_same_tree_and_answers_as_the_model():
    from agent_rl.envs.gui_browser import BrowserApp

    model = SettingsApp(PLAIN, layout=7)
    page = await BrowserApp.open(SettingsApp(PLAIN, layout=7))
    try:
        assert await page.tree() == TREE
        for action, *args in [("click", "e51"), ("select", "e93", "16"), ("type", "e19", 'Robin "R": yes'),
                              ("click", "e29"), ("select", "e60", "chime"), ("scroll", "down"), ("scroll", "down"),
                              ("scroll", "down"), ("click", "e21"), ("click", "e84"), ("type", "e40", "x"),
                              ("click", "e11"), ("scroll", "up"), ("click", "e40"), ("click", "e40"),
                              ("select", "e93", "15"), ("scroll", "left")]:
            answers = []
            for app in (model, page):
                try:
                    out = getattr(app, action)(*args)
                    answers.append(await out if app is page else out)
                except ActionError as e:
                    answers.append(f"Error: {e}")
            assert answers[0] == answers[1], (action, args)
            assert await page.tree() == model.tree(), (action, args)
        assert await page.values() == model.values()
    finally:
        await page.close()


@needs_browser
async def test_browser_episode_earns_full_reward_only_when_saved(scripted, renderer):
    from agent_rl.envs.gui_browser import BrowserGuiEnv

    async with BrowserGuiEnv(TASK) as env:
        traj = await run_episode(env, scripted(lambda m: solve(TASK, m, False), on_messages=True),
                                 renderer, LIMITS, "t")
    assert traj.reward == 1.0 and len(traj.tool_calls) == 6 and all(c.ok for c in traj.tool_calls)
    assert TREE in traj.messages[1].content

    def unsaved(messages):
        reply = solve(TASK, messages, False)
        return "done" if saves(reply) else reply

    async with BrowserGuiEnv(TASK) as env:
        traj = await run_episode(env, scripted(unsaved, on_messages=True), renderer, LIMITS, "t")
    assert traj.reward == 0.0 and traj.reward_parts["unsaved_changes"] == 3.0


# -- integration -------------------------------------------------------------------------------
@pytest.mark.integration
async def test_gui_env_against_a_real_server(play_on_server, renderer):
    limits = EpisodeLimits(max_turns=3, max_tokens_per_turn=48, max_total_tokens=2048, seed=0)
    groups = await play_on_server(load_tasks(2, seed=0), make_env, limits)
    for t in (t for g in groups for t in g.trajectories):
        assert t.reward in (0.0, 1.0) and 0.0 <= t.reward_parts["progress"] <= 1.0
        assert 'page "Settings"' in renderer.render_text(t.token_ids[:t.prompt_len])
