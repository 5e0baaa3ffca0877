"""The episode failure policy (`rollout.on_error`, `rollout.stream`): an environment that raises on its first
attempt for some tasks, in the real loop and stream with tests/helpers.py's scripted sampler. retry: every
step's batch equals the unfaulted run's, token for token; drop_group: the groups with a failed episode are out
of the update; keep: they train on their other episodes. Failures are counted by type (`error/<type>`)."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import TimedSampler, run_loop, scripted_run, total, toy_tasks

FLAKY = {"t1", "t5"}  # their first environment raises as it starts; every later one works


def flaky(run):
    """`run`'s environment, except that the first episode of each FLAKY task fails to start."""
    started: set[str] = set()
    make_env = run.session.env.make_env

    def make(task):
        if task["id"] in FLAKY and task["id"] not in started:
            started.add(task["id"])
            raise ValueError("flaky start")
        return make_env(task)

    run.session = dataclasses.replace(run.session, env=dataclasses.replace(run.session.env, make_env=make))
    return run


async def steps_of(tmp_path, smol_dir, renderer, *sets, faulty=True):
    run = scripted_run(tmp_path, smol_dir, renderer, toy_tasks(12), "algorithm.max_staleness=0", *sets)
    seen, lines = await run_loop(flaky(run) if faulty else run, TimedSampler(renderer, lambda prompt: 0.001))
    batches = [[(g.task_id, [(t.token_ids, t.reward, t.infra_error) for t in g.trajectories]) for g in groups]
               for groups in seen]
    return batches, lines


async def test_retry_makes_every_batch_the_unfaulted_one(tmp_path, smol_dir, renderer):
    clean, _ = await steps_of(tmp_path / "clean", smol_dir, renderer, faulty=False)
    retried, lines = await steps_of(tmp_path / "retry", smol_dir, renderer, "rollout.on_error=retry")
    assert retried == clean
    assert total(lines, "error/ValueError") == 2 and total(lines, "error/retried") == 2  # t1 and t5, once each
    assert total(lines, "error/dropped_groups") == 0


@pytest.mark.parametrize("max_retries", [0, 2])
async def test_drop_group_keeps_the_whole_group_out(max_retries, tmp_path, smol_dir, renderer):
    clean, _ = await steps_of(tmp_path / "clean", smol_dir, renderer, faulty=False)
    dropped, lines = await steps_of(tmp_path / "drop", smol_dir, renderer, "rollout.on_error=drop_group",
                                    f"rollout.max_retries={max_retries}", "algorithm.max_resample_batches=0")
    # 8 steps x 3 slots over 12 tasks: t1 and t5 play at steps 0 and 1 first (slots 1 and 5), then at 4 and 5
    expected = [[g for g in step if not (i < 2 and g[0] in FLAKY)] for i, step in enumerate(clean)]
    assert dropped == expected and [len(s) for s in dropped] == [2, 2, 3, 3, 3, 3, 3, 3]
    assert total(lines, "error/dropped_groups") == 2 and total(lines, "error/ValueError") == 2
    assert total(lines, "error/retried") == 0  # drop_group never retries, whatever max_retries says


async def test_a_dropped_group_gives_its_slot_to_the_next_task(tmp_path, smol_dir, renderer):
    # algorithm.max_resample_batches > 0: as a group lost whole to errors does (`rollout.stream`)
    dropped, _ = await steps_of(tmp_path, smol_dir, renderer, "rollout.on_error=drop_group",
                                "algorithm.max_resample_batches=1")
    assert [[g[0] for g in step] for step in dropped[:2]] == [["t0", "t2", "t3"], ["t4", "t6", "t7"]]


async def test_keep_trains_the_other_episodes_of_the_group(tmp_path, smol_dir, renderer):
    kept, lines = await steps_of(tmp_path, smol_dir, renderer, "rollout.on_error=keep")
    failed = [(i, task) for i, step in enumerate(kept) for task, trajs in step if any(t[2] for t in trajs)]
    assert failed == [(0, "t1"), (1, "t5")] and total(lines, "error/dropped_groups") == 0
    assert total(lines, "error/ValueError") == 2 and lines[0]["infra_error_rate"] == pytest.approx(1 / 6)


async def test_retry_past_its_budget_drops_the_group(tmp_path, smol_dir, renderer):
    run = scripted_run(tmp_path, smol_dir, renderer, toy_tasks(12, slow=1), "algorithm.max_staleness=0", "run.steps=1",
                       "rollout.on_error=retry", "rollout.max_retries=1", "algorithm.max_resample_batches=0")
    fail = TimedSampler(renderer, lambda prompt: 0.001, fail=lambda prompt: "snails" in prompt)  # t1
    seen, lines = await run_loop(run, fail)
    assert [g.task_id for g in seen[0]] == ["t0", "t2"]
    assert lines[0]["error/SamplerError"] == 4 and lines[0]["error/retried"] == 2  # 2 episodes x (1 + 1 retry)
    assert lines[0]["error/dropped_groups"] == 1


async def test_a_failure_is_typed_where_it_is_caught(renderer):
    """The type a failure is counted under is set by the code that caught it (`Trajectory.error_type`), not read
    back from its message: an environment that would not start, one that raised mid-episode, a group reward."""
    from agent_rl.core.env import Env
    from agent_rl.core.types import StopReason
    from agent_rl.rollout.runner import EpisodeLimits, play_task, score_group
    from agent_rl.rollout.scripted import ScriptedSampler

    class Raises(Env):
        async def initial_messages(self):
            raise OSError("no disk: ValueError")  # a message that names another type must not mislead

        async def step(self, message, turn):
            raise AssertionError("never reached")

        async def reward(self, messages):
            return 0.0

    def broken(task):
        raise ValueError("flaky start")

    sampler = ScriptedSampler(renderer, lambda messages: "a")
    limits = EpisodeLimits(max_turns=1)
    cannot_start = await play_task({"id": "a"}, 0, broken, sampler, renderer, limits)
    raised = await play_task({"id": "b"}, 0, lambda task: Raises(), sampler, renderer, limits)
    assert (cannot_start.error_type, cannot_start.error) == ("ValueError", "environment could not start: "
                                                                           "ValueError: flaky start")
    assert (raised.error_type, raised.error) == ("OSError", "OSError: no disk: ValueError")
    ended = dataclasses.replace(raised, stop_reason=StopReason.NO_TOOL_CALL, error=None, error_type="")

    def bad_group_reward(task, trajectories):
        raise RuntimeError("judge down")

    [scored] = await score_group(bad_group_reward, {"id": "b"}, [ended], 5.0)
    assert scored.error_type == "group_reward" and scored.error == "group reward failed: RuntimeError: judge down"
