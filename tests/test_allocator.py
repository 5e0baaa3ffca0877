"""Freed host memory goes back to the OS after every optimizer step (glibc malloc_trim)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from agent_rl.learn import update

# a trainer's pattern in miniature: a large buffer freed (glibc then raises its dynamic threshold),
# then many large buffers of varying size interleaved with small long-lived allocations, all freed
CHURN = textwrap.dedent("""
    import sys
    from agent_rl.learn.allocator import cap_heap_buffers, release_freed_memory
    capped = cap_heap_buffers() if sys.argv[1] == "cap" else None
    def rss_mb():
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) // 1024
    x = bytearray(8 << 20); del x
    big, small = [], []
    for i in range(64):
        big.append(bytearray((4 << 20) + i * 4096)); small.append(bytearray(600))
    held = rss_mb(); del big
    released = release_freed_memory() if sys.argv[1] == "release" else capped
    print(held, rss_mb(), released)
""")


def _churn(mode: str) -> tuple[int, int, str]:
    out = subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True, timeout=60, check=True)
    held, after, released = out.stdout.split()
    return int(held), int(after), released


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and calls glibc's malloc_trim")
def test_freed_buffers_leave_the_process_only_when_released():
    held, after, _ = _churn("keep")
    assert held > 250 and after > 250, "glibc's default heap keeps the freed 256 MB resident (the failure)"
    held, after, released = _churn("release")
    assert released == "True" and held > 250 and after < 64, f"released, yet {after} MB stay resident"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and calls glibc's mallopt")
def test_capped_heap_buffers_leave_the_process_as_they_are_freed():
    """Within a step nothing is trimmed: buffers of 4 MiB and more must be mappings of their own."""
    held, after, capped = _churn("cap")
    assert capped == "True" and held > 250 and after < 64, f"capped, yet {after} MB stay resident"


def test_a_cpu_policy_caps_heap_buffers(monkeypatch):
    from agent_rl.learn import policy

    calls = []
    monkeypatch.setattr(policy, "cap_heap_buffers", lambda: calls.append(1) or True)
    monkeypatch.setattr(policy, "load_causal_lm", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("stop here")))
    cfg = type("M", (), {"device": "cpu", "dtype": "auto"})()
    with pytest.raises(RuntimeError, match="stop here"):
        policy.build_policy(cfg, None, "unused")
    assert calls == [1]


def test_optimizer_step_clips_steps_and_releases(monkeypatch):
    calls = []
    monkeypatch.setattr(update, "release_freed_memory", lambda: calls.append(1) or True)
    w = torch.nn.Parameter(torch.tensor([1.0, 1.0]))
    idle = torch.nn.Parameter(torch.tensor([5.0]))  # no gradient: left out of the norm and the step
    opt = torch.optim.SGD([w, idle], lr=1.0)
    (3.0 * w[0] + 4.0 * w[1]).backward()  # grad (3, 4): norm 5, clipped to norm 1 -> (0.6, 0.8)
    assert update.optimizer_step(opt, grad_clip=1.0) == pytest.approx(5.0)
    assert w.detach().tolist() == pytest.approx([0.4, 0.2]) and idle.item() == 5.0
    assert calls == [1]
    opt.zero_grad(set_to_none=True)
    w.grad = None
    assert update.optimizer_step(torch.optim.SGD([idle], lr=1.0), grad_clip=1.0) == 0.0 and calls == [1, 1]
