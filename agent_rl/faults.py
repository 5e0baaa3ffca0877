"""What a training run does about a fault it meets in its servers, in words a user reads.

Owns: the rule for whether a step trained what an unfaulted run would (`mended`: its failures all mended by
retries, so its checkpoint holds nothing a fault changed), and the line a run ends with when a server is gone
for good (`server_gone`: a push a server would not take, or a server past its restart budget or attach wait,
with the checkpoint to go on from).
Does not own: mending (`rollout.supervisor` restarts servers, `rollout.stream` replays episodes), when the run
stops and what it checkpoints (`trainer`), how the line is printed (`commands.errors_as_lines`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from agent_rl.core.types import Trajectory
from agent_rl.runs.checkpoint import latest_step

RETRY_COUNTS = ("error/retried", "error/dropped_groups")  # the stream's counts that are not failures themselves


def mended(metrics: dict[str, float], trajs: Sequence[Trajectory]) -> bool:
    """The step trained what an unfaulted run would: no episode failed, or each failure was mended by a retry
    (a server that died may have failed the step's episodes, whose tasks a checkpoint would count as trained).
    Episodes replayed after their server died (`fault/replayed_episodes`) are not failures."""
    failures = sum(v for k, v in metrics.items() if k.startswith("error/") and k not in RETRY_COUNTS)
    return not any(t.infra_error for t in trajs) and failures == metrics.get("error/retried", 0.0)


def server_gone(run_dir: Path, error: Exception, saved: int | None) -> Exception:
    """`error` (of its own type), with where the run can go on from: step `saved`, or the last checkpoint written."""
    last = saved if saved is not None else latest_step(run_dir)
    where = f"checkpoint of step {last} in {run_dir}/checkpoints" if last else "no checkpoint written"
    return type(error)(f"{error} ({where}; continue with the same command and --resume once the servers answer)")
