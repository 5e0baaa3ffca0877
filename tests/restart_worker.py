"""`agent-rl train` for tests/test_restarts_integration.py, whose server is SIGKILLed at chosen points of the run.

argv: KILLS [CLI ARGS...]. KILLS is a comma-separated list of policy versions ("" for none): when the first request
sampled under version v is about to go out (step v + 1 of the run, as `agent-rl` counts steps, is sampling), the
run's vLLM server is frozen (SIGSTOP to its process group), and 100 ms later (a thread's timer) SIGKILLed as an
out-of-memory kill would end it: its leader alone (the engine processes it started stay behind, for the supervisor
to clean up; they are let go on, SIGCONT, as the leader dies). Frozen first, so that the step's requests are in
flight when it dies whatever the timing: a server that ran on answered every request of a step before a fixed
delay's kill when the run's process was slow to run the timer or the server fast (CI failed so twice). The server is
the vLLM child of this process (started by the run, restarted by its supervisor), or the process whose pid is in the
environment variable AGENT_RL_TEST_KILL_PID (a server the run attached to by URL; then its whole process group is
killed, so that it does not come back). Each killed process group is appended to RUN_DIR/killed.txt, and the groups
of the servers it started as each version's first request goes out to RUN_DIR/servers.txt. Otherwise the command is
exactly `agent-rl train` (`cli.main`: its lines and exit statuses), with the real loop, stream, supervisor and weight
sync.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import threading
from pathlib import Path

from agent_rl import cli, trainer


def vllm_children() -> list[int]:
    """This process's children that run a vLLM server."""
    out = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = Path(f"/proc/{p}/cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if ppid == os.getpid() and b"vllm.entrypoints" in cmd:
            out.append(int(p))
    return out


class Killing:
    """The run's sampler, which SIGKILLs the server once per version of `versions` (module doc)."""

    def __init__(self, inner, versions: set[int], run_dir: Path):
        self.inner, self.versions, self.run_dir = inner, set(versions), run_dir
        self.seen: set[int] = set()  # versions whose first request went out

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    async def sample(self, prompt_ids, params, messages=()):
        version = self.inner.policy_version
        if version not in self.seen:
            self.seen.add(version)
            with (self.run_dir / "servers.txt").open("a") as f:
                f.writelines(f"{os.getpgid(pid)}\n" for pid in vllm_children())
        if version in self.versions:
            self.versions.discard(version)
            self.freeze()
        return await self.inner.sample(prompt_ids, params, messages)

    def freeze(self) -> None:
        """Stop the server's processes now, before the request goes out, and kill it 100 ms later (module doc)."""
        attached = os.environ.get("AGENT_RL_TEST_KILL_PID")
        [pid] = [int(attached)] if attached else vllm_children()
        group = os.getpgid(pid)
        os.killpg(group, signal.SIGSTOP)
        threading.Timer(0.1, self.kill, (pid, group, bool(attached))).start()

    def kill(self, pid: int, group: int, attached: bool) -> None:
        with (self.run_dir / "killed.txt").open("a") as f:
            f.write(f"{group}\n")
        if attached:
            os.killpg(group, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):  # the engine processes it leaves run on, as after a real kill
                os.killpg(group, signal.SIGCONT)


def main(kills: str, argv: list[str]) -> int:
    versions = {int(v) for v in kills.split(",") if v}
    run_dir = Path(next(a.split("=", 1)[1] for a in argv if a.startswith("run.run_dir=")))
    train = trainer.train

    async def killing_train(cfg, resume=False, stages=trainer.Stages()):
        def stream(run, players):  # episodes play in this process: the meter's sampler is the run's
            players.meter.inner = Killing(players.meter.inner, versions, run_dir)
            return trainer.open_stream(run, players)

        return await train(cfg, resume, dataclasses.replace(stages, stream=stream))

    trainer.train = killing_train  # what `agent-rl train` (commands.train) calls
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
