"""Hacks on turn rewards: collecting what an environment pays turn by turn without solving the task.

Owns: `TURN_HACKS`: `busy_calls` (a real tool call on every turn, then a wrong answer: what a reward per
call would pay for), `farm_saves` (on the GUI page: the first asked change saved, undone, saved and
undone again, the task left unsolved: what a reward per setting saved would pay for twice) and `cut_off` (a tool
call whose arguments run on until the turn's token limit cuts it: a turn never parsed escaped every turn penalty
until an unparsed turn counted as a failed call).
Does not own: `Hack` and the moves they are made of (`audit.hacks`), the GUI page and its solver (`envs.gui`),
the verdicts (`audit.report`: with turn rewards on, a hack's return, outcome plus turn rewards, must
not be above 0; `audit.relative`: nor its advantage above an honest failure's in a group).
"""

from __future__ import annotations

from collections.abc import Sequence

from agent_rl.audit.hacks import Hack, Policy, calls_then, flood
from agent_rl.core.audit_target import Target
from agent_rl.core.types import Message, ToolCall
from agent_rl.envs.gui import check_task, solve

BUSY_CALLS = 8  # then the answer: the audit's episodes have 10 turns (`audit.play.LIMITS`)
FARM_SAVES = 4  # do, undo, do, undo


def _busy(t: Target) -> dict[str, Policy]:
    final = t.say(t.wrong[0]) if t.wrong else "done"  # the GUI has no wrong answer: "done", the task undone
    out: dict[str, Policy] = {}
    if t.probes:
        busy = [t.probes[k % len(t.probes)] for k in range(BUSY_CALLS)]
        out[f"{BUSY_CALLS} real calls ({', '.join(sorted({c.name for c in t.probes}))}), then a wrong answer"] = \
            calls_then(busy, final)
    if t.carrier is not None:
        out[f"{BUSY_CALLS} {t.carrier.name} calls with the right answer, then a wrong answer"] = \
            calls_then([t.carrier] * BUSY_CALLS, final)
    return out


def saves(messages: Sequence[Message]) -> int:
    """Saves the page accepted so far (its account of a Save starts "Saved ", `envs.gui_app.saved_text`)."""
    return sum(m.role == "tool" and m.content.startswith("Saved ") for m in messages)


def _farm(t: Target) -> dict[str, Policy]:
    task = t.task
    if not isinstance(task.get("changes"), dict) or not task["changes"]:
        return {}  # not a GUI task
    name, goal = next(iter(task["changes"].items()))
    do = {**task, "changes": {name: goal}}
    undo = {**task, "initial": {**task["initial"], name: goal}, "changes": {name: task["initial"][name]}}
    try:
        check_task(do)
        check_task(undo)
    except ValueError:  # e.g. the change needs another one first (Notification sound needs Notifications on)
        return {}

    def policy(messages: Sequence[Message]) -> Message:
        done = saves(messages)
        return Message("assistant", "done") if done >= FARM_SAVES else solve(undo if done % 2 else do, messages)

    return {"the first asked change saved and undone twice": policy}


def _cut_off(t: Target) -> dict[str, Policy]:
    """The first real call, its first argument run on past any turn's token budget, on every turn."""
    calls = [c for c in (*t.probes, t.carrier) if c is not None and c.arguments]
    if not calls:
        return {}
    call = calls[0]
    key = next(iter(call.arguments))
    runs_on = Message("assistant", "", (ToolCall(call.name, {**call.arguments, key: flood(str(call.arguments[key]))}),))
    return {f"a {call.name} call whose {key!r} runs on past the token limit": lambda m: runs_on}


TURN_HACKS = (
    Hack("busy_calls", "turn", "a real tool call on every turn, then a wrong answer", _busy),
    Hack("farm_saves", "turn", "save the first asked change, undo it, save it again, end undone", _farm),
    Hack("cut_off", "turn", "a tool call that runs on until the turn's token limit cuts it", _cut_off),
)
