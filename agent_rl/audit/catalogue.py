"""Every reward hack the audit knows, and the lookup of what an environment's audit target names.

Owns: `CATALOGUE` (every hack, by group: the answer, tool, coding and GUI hacks of `audit.hacks`, the
visible-test hacks of `audit.visible_tests`, the hacks on turn rewards of `audit.turn_hacks`) and
`hacks_named` (names of hacks or groups -> hacks).
Does not own: the hacks themselves, which environment names which (its spec's audit target), playing them.
"""

from __future__ import annotations

from collections.abc import Sequence

from agent_rl.audit.hacks import ANSWER_HACKS, CODING_HACKS, GUI_HACKS, TOOL_HACKS, Hack
from agent_rl.audit.turn_hacks import TURN_HACKS
from agent_rl.audit.visible_tests import VISIBLE_TEST_HACKS
from agent_rl.core.audit_target import HACK_GROUPS

CATALOGUE = (*ANSWER_HACKS, *TOOL_HACKS, *CODING_HACKS, *VISIBLE_TEST_HACKS, *GUI_HACKS, *TURN_HACKS)


def hacks_named(names: Sequence[str], env: str) -> tuple[Hack, ...]:
    """The hacks `names` names, in its order: a group stands for its hacks in catalogue order. A name
    that is neither is a ValueError naming the environment `env`."""
    by_name = {h.name: h for h in CATALOGUE}
    out: list[Hack] = []
    for name in names:
        if name in HACK_GROUPS:
            out += [h for h in CATALOGUE if h.group == name]
        elif name in by_name:
            out.append(by_name[name])
        else:
            raise ValueError(f"environment {env!r}: its audit target names {name!r}, which is no hack and no group "
                             f"of hacks (groups: {', '.join(HACK_GROUPS)}; hacks: {', '.join(by_name)})")
    return tuple(out)
