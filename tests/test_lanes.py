"""`make test`'s two lanes (conftest's --lane): every module runs in exactly one, and the own lane never asks for a
session server or the Ray cluster (it would start its own copies beside the shared lane's)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# one module of each kind: session servers, the Ray cluster, servers of its own, plain unit tests
MODULES = ["tests/test_learning.py", "tests/test_workers_push.py", "tests/test_faults_integration.py",
           "tests/test_loss.py"]


def collected(*args: str) -> set[str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args,
                           *MODULES], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return {line.split("::")[0] for line in proc.stdout.splitlines() if "::" in line}


def test_each_module_runs_in_one_lane_and_the_own_lane_shares_nothing():
    shared, own = collected("--lane", "shared"), collected("--lane", "own")
    assert shared == {"tests/test_learning.py", "tests/test_workers_push.py"}
    assert own == {"tests/test_faults_integration.py", "tests/test_loss.py"}
    assert shared | own == set(MODULES)


def test_a_bad_lane_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "--lane", "both", MODULES[-1]],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 4 and "argument --lane: invalid choice: 'both'" in proc.stderr, proc.stderr
