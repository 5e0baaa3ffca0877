"""bench/turn_parts.py runs as its docstring says and times every part it names, each counted where the runner's
side calls it (a part never reached would read 0 and hide what a turn costs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "turn_parts.py"


@pytest.mark.timeout(180)
def test_every_part_of_a_turn_is_timed_where_the_runner_calls_it():
    done = subprocess.run([sys.executable, str(SCRIPT), "--servers", "8", "--concurrency", "32", "--warmup", "1",
                           "--window", "2"], capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(done.stdout.strip().splitlines()[-1])
    parts = {"reading the response", "_completion", "decoding and parsing", "token buffer", "request JSON",
             "tool argument check", "tool call pipe write", "next context", "servers: reply choice"}
    assert set(row["parts_us_per_turn"]) == parts and all(v > 0 for v in row["parts_us_per_turn"].values())
    calls = row["calls_per_turn"]
    assert row["turns"] > 100 and calls["_completion"] == calls["decoding and parsing"] == 1.0
    # a call on every turn but the last; a worker's first call is written after its import's request
    assert 0 < calls["tool argument check"] <= calls["tool call pipe write"] < 1
    assert sum(row["parts_us_per_turn"].values()) < 1000 * row["cpu_ms_per_turn"]
