"""Joining a Ray cluster, or starting one on this machine, for the rollout workers (`rollout.workers`).

Owns: `connected` (`ray.address`, else RAY_ADDRESS, else a cluster of this machine with room for the workers:
their CPUs and custom resources, stopped after), `answers` (whether anything listens at a cluster's address,
with a deadline: one line in seconds, where Ray's own client retries for minutes), the process's own SIGTERM
handler kept across `ray.init` (which would make SIGTERM exit at once).
Does not own: the workers (`rollout.ray_pool`), the entry a run calls (`rollout.workers`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import socket
import threading
from collections.abc import Iterator

import ray

from agent_rl.core.config import ConfigError, RayConfig


def first_line(e: BaseException) -> str:
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    return lines[0] if lines else type(e).__name__


def answers(where: str, address: str) -> None:
    """Whether anything listens at the cluster's address, with a 5 s deadline: Ray itself retries for minutes."""
    if address == "auto":
        return  # Ray looks for a cluster on this machine and says at once if there is none
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=5.0):
            pass
    except (OSError, ValueError) as e:
        raise ConfigError(where, f"no Ray cluster answers at {address} ({type(e).__name__}: {e}); start its head "
                                 f"(ray start --head) or fix the address") from None


@contextlib.contextmanager
def connected(settings: RayConfig, workers: int) -> Iterator[None]:
    """Ray initialised for the block, then shut down; left as it is when the caller has initialised it already.
    `ray.address` (else RAY_ADDRESS) joins that cluster; without one (or with `local`) a cluster of this machine
    starts with room for the workers: at least their CPUs, and the custom resources they ask for."""
    if ray.is_initialized():
        yield
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a run phones nobody
    where, address = ("ray.address", settings.address) if settings.address else \
        ("RAY_ADDRESS", os.environ.get("RAY_ADDRESS"))
    if address and address != "local":
        answers(where, address)
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        if address and address != "local":
            ray.init(address=address, logging_level=logging.ERROR)
        else:
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, math.ceil(workers * settings.num_cpus)),
                     resources={k: v * workers for k, v in settings.resources.items()}, include_dashboard=False,
                     object_store_memory=512 * 2**20, logging_level=logging.ERROR)
    except (ConnectionError, RuntimeError, ValueError) as e:
        what = f"could not join the Ray cluster at {address}" if address and address != "local" else \
            "could not start a Ray cluster on this machine"
        raise ConfigError(where, f"{what}: {first_line(e)}") from None
    finally:  # ray.init makes SIGTERM exit the process at once; the run's own handling stays (`cli`, `stopping`)
        if threading.current_thread() is threading.main_thread() and sigterm is not None:
            signal.signal(signal.SIGTERM, sigterm)
    try:
        yield
    finally:
        ray.shutdown()
