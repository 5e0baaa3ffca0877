"""Branching at the tool decision (`rollout.branching`, the engine's tree groups, `learn.advantages`' tree estimator)
and the tool-decision diagnostics (`runs.metrics.tool_decision_metrics`), against hand-worked numbers: a scripted
policy that never calls the calculator gets branches that open a call and solve the task; one whose calls are all
wrong gets its call resampled after the reasoning it kept; the tree's advantages, the shared prefix packed once and
the update's gradient equal to the tree loss written out by hand; and branching off leaves every episode as it was."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from branch_kits import OPENING, branch_kit, calculator_script

from agent_rl.core.returns import scored
from agent_rl.core.types import Branch, StopReason, ToolCall, ToolCallRecord, Trajectory, TrajectoryGroup, Turn
from agent_rl.envs.calculator import CalculatorEnv, arithmetic_tasks
from agent_rl.learn.advantages import dr_grpo_advantages, group_advantages, grpo_advantages, tree_advantages
from agent_rl.learn.batching import collate
from agent_rl.learn.logprobs import token_logprobs
from agent_rl.learn.packing import pack_rows
from agent_rl.rollout.branching import BranchRule, BranchSampler, branches
from agent_rl.rollout.engine import Episodes, play_groups
from agent_rl.rollout.players import LocalPlayers
from agent_rl.rollout.runner import EpisodeLimits
from agent_rl.rollout.sampler import SamplingParams
from agent_rl.rollout.scripted import ScriptedSampler
from agent_rl.runs.metrics import branch_metrics, tool_decision_metrics

LIMITS = EpisodeLimits(max_turns=3, max_tokens_per_turn=64, max_total_tokens=1024, seed=11)


def traj(reward: float, tools: int = 0, stop: StopReason = StopReason.NO_TOOL_CALL, branch: Branch | None = None,
         logprobs: tuple[float, ...] = ()) -> Trajectory:
    """A one-turn episode with `tools` calls and the given sampled log-probs (its turn: the tokens after a 2-token
    prompt)."""
    n = len(logprobs)
    records = tuple(ToolCallRecord("calculator", False, "bad", 0.0, 0) for _ in range(tools))
    return Trajectory("q", tuple(range(2 + n)), (0, 0) + (1,) * n, (0.0, 0.0) + logprobs, 2,
                      (Turn(2, 2 + n, "stop", 0),) if n else (), (), records, stop, reward=reward, branch=branch)


def timeless(t: Trajectory) -> Trajectory:
    """All of a trajectory but its wall-clock figures (the seconds its reward and its tool calls took)."""
    return replace(t, reward_s=0.0, tool_calls=tuple(replace(c, latency_s=0.0) for c in t.tool_calls))


def group(*trajs: Trajectory) -> TrajectoryGroup:
    return TrajectoryGroup("q", scored(trajs))


# -- the diagnostics --------------------------------------------------------------------------------------------


def test_the_tool_decision_metrics_by_hand():
    """Three groups of two: A never tries a tool (0, 0); B's one tool-using rollout fails (0), its other solves
    without a tool (1); C's two tool users, one solving (1, 0). A branch and an infrastructure error are left out.
    Attempts 3 of 6; no-attempt groups 1 of 3 (A); all-fail groups 1 of 3 (B: C has a solving tool user); reward with
    tools (0 + 1 + 0) / 3, without (0 + 0 + 1) / 3."""
    a = group(traj(0.0), traj(0.0), traj(1.0, tools=1, branch=Branch(0, (), (), (1,))))
    b = group(traj(0.0, tools=1), traj(1.0), traj(1.0, stop=StopReason.ERROR))
    c = group(traj(1.0, tools=2), traj(0.0, tools=1))
    m = tool_decision_metrics([a, b, c])
    assert m == pytest.approx({"tool/attempt_share": 3 / 6, "tool/no_attempt_groups": 1 / 3,
                               "tool/all_fail_groups": 1 / 3, "reward/with_tools": 1 / 3,
                               "reward/without_tools": 1 / 3}, abs=1e-12)
    assert tool_decision_metrics([c])["tool/all_fail_groups"] == 0.0 and "reward/without_tools" not in \
        tool_decision_metrics([c])
    # the branch: 1 of the 8 episodes; it attempted a call and solved its task
    assert branch_metrics([a, b, c]) == pytest.approx({"branch/episodes": 1.0, "branch/share": 1 / 8,
                                                        "branch/token_share": 0.0, "branch/groups": 1.0,
                                                        "branch/attempt_share": 1.0, "branch/solved_share": 1.0})
    assert branch_metrics([b, c]) == {}


# -- the tree's advantages --------------------------------------------------------------------------------------


def test_tree_advantages_by_hand():
    """Leaves o0, o1 (the group's own episodes, returns 0 and 0), b0 a branch of o0 that kept some of o0's ids
    (return 1), b1 a branch of o1 at its turn's start, keeping none (return 0). Each leaf's baseline is the mean
    return of the leaves whose returns do not depend on its own sampled ids: o0's leaves out b0 (b0 depends on
    o0's kept ids), o1's leaves out nothing but itself (b1 keeps none of o1's ids), a branch's leaves out itself.
        o0: 0 - mean(o1, b1) = 0 - 0 = 0          b0: 1 - mean(o0, o1, b1) = 1
        o1: 0 - mean(o0, b0, b1) = -1/3           b1: 0 - mean(o0, o1, b0) = -1/3
    GRPO divides them by the sample std of all four returns (0, 0, 1, 0): mean 1/4, squares 3/16 + 9/16 = 3/4,
    / 3 = 1/4, std 1/2 (+ eps 1e-6)."""
    b0, b1 = Branch(0, (), (5, 6)), Branch(1, (), (), (7,))
    g = group(traj(0.0, logprobs=(-1.0,) * 3), traj(0.0, logprobs=(-1.0,) * 3),
              traj(1.0, branch=b0, logprobs=(-1.0,)), traj(0.0, branch=b1, logprobs=(-1.0,)))
    dr = group_advantages([g], dr_grpo_advantages)
    assert list(dr.advantages) == pytest.approx([0.0, -1 / 3, 1.0, -1 / 3], abs=1e-12)
    grpo = group_advantages([g], grpo_advantages)
    assert list(grpo.advantages) == pytest.approx([a / (0.5 + 1e-6) for a in (0.0, -1 / 3, 1.0, -1 / 3)], abs=1e-12)
    # the function itself: a leaf whose baseline may see no leaf gets 0
    alone = tree_advantages(torch.tensor([3.0, 1.0], dtype=torch.float64), torch.ones(2, 2, dtype=torch.bool), None)
    assert alone.tolist() == [0.0, 0.0]


def test_a_tree_needs_an_estimator_of_the_table():
    g = group(traj(0.0, logprobs=(-1.0,)), traj(1.0, branch=Branch(0, (), (), (1,)), logprobs=(-1.0,)))
    with pytest.raises(ValueError, match=r"a group with branches \(algorithm.tool_branches\) needs an estimator"):
        group_advantages([g], lambda rewards: rewards - rewards.mean())


# -- where a group branches -------------------------------------------------------------------------------------


def test_the_most_uncertain_turn_starts_are_chosen_and_the_budget_kept():
    """A group of 4 that never called a tool, budget 0.5: 2 branches, forced at a turn's start. Each episode has
    one turn: its first sampled token's surprisal is 1, 3, 2, 3 (-log-prob). Every cut has the same prefix (the
    prompt: no turn before, nothing kept), so the distinct cuts are one, and both branches start there."""
    trajs = [traj(0.0, logprobs=(-s, -0.1)) for s in (1.0, 3.0, 2.0, 3.0)]
    rule = BranchRule(0.5, (9, 9))
    assert branches(rule, trajs) == [Branch(1, (), (), (9, 9))] * 2
    assert branches(BranchRule(0.5, (9, 9), force=False), trajs) == []  # no forcing: nothing to branch at
    assert branches(BranchRule(0.1, (9,)), trajs) == [Branch(1, (), (), (9,))]  # at least one
    solved_without = [traj(1.0, logprobs=(-1.0,)), *trajs[1:]]
    assert branches(rule, solved_without) == branches(rule, trajs)  # no attempt at all: it branches anyway
    solved_with = [traj(1.0, tools=1, logprobs=(-1.0,)), *trajs[1:]]
    assert branches(rule, solved_with) == []  # a tool user solved: the call has its signal


def test_a_failed_call_is_resampled_after_the_lines_before_it(renderer):
    """A tool user whose call failed: the cuts are its turn's start and each line start up to the call's own line
    (the reasoning before the call kept, the call resampled from its start), the most uncertain first; never a cut
    inside the call, however uncertain the policy was there."""
    text = 'First I think.\nThen the call:\n<tool_call>\n{"name": "calculator", "arguments": {}}\n</tool_call>'
    ids = [*renderer.encode_reply(text), renderer.stop_token_ids[0]]
    lines = [k for k in range(1, len(ids)) if renderer.decode_raw([ids[k - 1]]).endswith("\n")]
    logprobs = [-0.1] * len(ids)
    logprobs[lines[2]] = -9.0  # after "<tool_call>": inside the call
    logprobs[lines[1]] = -4.0  # the start of the call's line: both lines of reasoning kept
    logprobs[lines[0]] = -2.0  # the start of "Then the call:"
    message = renderer.parse(ids)
    t = Trajectory("q", (1, 2, *ids), (0, 0) + (1,) * len(ids), (0.0, 0.0, *logprobs), 2,
                   (Turn(2, 2 + len(ids), "stop", 0),), (message,),
                   (ToolCallRecord("calculator", True, None, 0.0, 0),), StopReason.NO_TOOL_CALL, reward=0.0)
    rule = BranchRule(1.5, tuple(renderer.call_opening()), token_text=lambda i: renderer.decode_raw([i]))
    chosen = branches(rule, [t, traj(0.0, logprobs=(-1.0,))])
    assert chosen == [Branch(0, (), tuple(ids[:lines[1]])), Branch(0, (), tuple(ids[:lines[0]])), Branch(0, (), ())]


async def test_the_branch_sampler_gives_what_it_keeps_and_samples_the_rest(renderer, scripted):
    """Turn 0 replayed as given (the source's ids, given: all of them); turn 1 starts with the kept and forced ids,
    given, then the inner sampler's reply; turn 2 is the inner sampler's alone."""
    inner = scripted(lambda text: "ok")
    sampler = BranchSampler(inner, Branch(0, ((1, 2, 3),), (4,), (5, 6)))
    params = SamplingParams(max_tokens=32, stop_token_ids=tuple(renderer.stop_token_ids))
    first = await sampler.sample([0], params)
    second = await sampler.sample([0, 1, 2, 3, 9], params)
    third = await sampler.sample([0], params)
    reply = [*renderer.encode_reply("ok"), renderer.stop_token_ids[0]]
    assert (first.token_ids, first.given, first.logprobs) == ((1, 2, 3), 3, (0.0,) * 3)
    assert (second.token_ids, second.given) == ((4, 5, 6, *reply), 3) and second.logprobs[3:] == (-0.5,) * len(reply)
    assert inner.calls[0] == [0, 1, 2, 3, 9, 4, 5, 6]  # the inner sampler saw the kept and forced ids
    assert (third.token_ids, third.given) == (tuple(reply), 0)
    cut = await BranchSampler(inner, Branch(0, (), (4, 4, 4), (5,))).sample([0], SamplingParams(max_tokens=2))
    assert (cut.token_ids, cut.given, cut.finish_reason) == ((4, 4), 2, "length")


# -- a group played through the engine --------------------------------------------------------------------------


async def play(renderer, script, budget: float, group_size: int = 4, force: bool = True):
    sampler = ScriptedSampler(renderer, script, logprob=-0.5)
    rule = None if budget == 0 else BranchRule(budget, tuple(renderer.call_opening()), force,
                                               token_text=lambda i: renderer.decode_raw([i]))
    episodes = Episodes(LocalPlayers(CalculatorEnv, sampler, renderer), LIMITS, group_size, branching=rule)
    [g] = await play_groups(arithmetic_tasks(2)[1:2], episodes)  # "What is a * b?"
    return g


async def test_a_group_that_never_calls_a_tool_branches_into_calls_that_solve_it(renderer):
    opening = renderer.render_text(renderer.call_opening())
    assert opening == OPENING
    plain = await play(renderer, calculator_script(opening), budget=0.0)
    g = await play(renderer, calculator_script(opening), budget=0.5)
    own, branched = g.trajectories[:4], g.trajectories[4:]
    # the group's own episodes, token for token as without branching
    assert [timeless(t) for t in own] == [timeless(t) for t in plain.trajectories]
    assert all(not t.used_tools and t.reward == 0.0 for t in own)
    assert len(branched) == 2 and all(t.branch is not None and t.used_tools and t.reward == 1.0 for t in branched)
    for t in branched:  # the forced opening: context; the rest of the turn: sampled, at the sampler's log-prob
        turn = t.turns[0]
        forced = len(t.branch.forced)
        assert t.token_ids[turn.start:turn.start + forced] == t.branch.forced
        assert t.loss_mask[turn.start:turn.start + forced] == (0,) * forced
        assert set(t.loss_mask[turn.start + forced:turn.end]) == {1}
        assert set(t.logprobs[turn.start + forced:turn.end]) == {-0.5}
    # with the calculator's result the branches solve it: the tree tells them from the group's own episodes
    adv = group_advantages([g], dr_grpo_advantages)
    # each leaf against the other five (no branch keeps an id of its source): 0 - 2/5, and 1 - 1/5
    assert list(adv.advantages) == pytest.approx([-2 / 5] * 4 + [4 / 5] * 2, abs=1e-12)
    assert tool_decision_metrics([g])["tool/no_attempt_groups"] == 1.0  # the policy's own choice, not the branches'


async def test_a_group_whose_calls_all_fail_resamples_the_call_after_its_reasoning(renderer):
    """Every episode reasons, then calls the calculator on the wrong expression. Two branches (budget 0.5 of 4),
    unforced: the turn's start, and after the reasoning's line (the call's own line is never a cut; the scripted
    log-probs are all equal, so the two distinct cuts are taken in order). Kept, the reasoning leads to the right
    call; resampled from the start, the policy repeats its wrong one."""
    g = await play(renderer, calculator_script(OPENING, wrong_call=True), budget=0.5)
    own, branched = g.trajectories[:4], g.trajectories[4:]
    assert all(t.used_tools and t.reward == 0.0 for t in own)
    reasoning = tuple(renderer.encode_reply("Let me compute.\n"))
    assert [(b.branch.kept, b.branch.forced, b.reward) for b in branched] == [((), (), 0.0), (reasoning, (), 1.0)]
    keep = branched[1]
    source, turn = own[keep.branch.source], keep.turns[0]
    assert keep.token_ids[:turn.start + len(reasoning)] == source.token_ids[:turn.start + len(reasoning)]
    assert keep.loss_mask[turn.start:turn.start + len(reasoning)] == (0,) * len(reasoning)  # trained in the source
    # dr_grpo over the tree: the source's baseline leaves out the branch that kept its ids, 0 - mean(0, 0, 0, 0);
    # the branch's is the five others, 1 - 0; another episode's, 0 - mean(0, 0, 0, 0, 1) = -1/5
    adv = group_advantages([g], dr_grpo_advantages)
    assert adv.advantages[keep.branch.source] == pytest.approx(0.0, abs=1e-12)
    assert adv.advantages[5] == pytest.approx(1.0, abs=1e-12)
    assert [a for i, a in enumerate(adv.advantages) if i not in (keep.branch.source, 5)] == \
        pytest.approx([-1 / 5] * 4, abs=1e-12)


# -- the batch: the shared prefix once, and the update's gradient is the tree loss ------------------------------


def tree_rows(policy) -> list[Trajectory]:
    """A source (prompt 4, turn 10 sampled) and a branch that kept its first 6 turn ids and sampled 5 more, and a
    second episode (prompt, 8 sampled): log-probs the model's own (every importance weight 1)."""
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(5, 1000, (4,), generator=gen).tolist()
    source = prompt + torch.randint(5, 1000, (10,), generator=gen).tolist()
    branch = source[:10] + torch.randint(5, 1000, (5,), generator=gen).tolist()
    other = prompt + torch.randint(5, 1000, (8,), generator=gen).tolist()
    rows = []
    kept = Branch(0, (), tuple(source[4:10]))
    for ids, start, b, reward in ((source, 4, None, 0.0), (branch, 10, kept, 1.0), (other, 4, None, 0.0)):
        x = torch.tensor([ids])
        with torch.no_grad():
            logp = token_logprobs(policy.model, x, torch.ones_like(x)).logp_B_T[0]
        mask = [0] * start + [1] * (len(ids) - start)
        lp = [0.0] + [float(logp[t - 1]) if mask[t] else 0.0 for t in range(1, len(ids))]
        rows.append(Trajectory("q", tuple(ids), tuple(mask), tuple(lp), 4, (Turn(4, len(ids), "stop", 0),), (), (),
                               StopReason.NO_TOOL_CALL, reward=reward, branch=b))
    return rows


def test_the_shared_prefix_is_packed_once_and_the_update_is_the_tree_loss(tiny_dir):
    """Packed, the three rows (14, 15 and 12 tokens) run 14 + 5 + 8 = 27 positions: the branch's 10 given tokens
    and the other episode's prompt are the source's. At one optimizer step the ratio is 1 and every weight 1, so the
    PPO loss's gradient is that of -(1/N) sum_l A_l sum_{t in l's sampled tokens} log pi(t), N = 10 + 5 + 8 sampled
    tokens: A = (0 - mean(0)) = 0 for the source (its branch left out of its baseline), 1 - mean(0, 0) = 1 for the
    branch, 0 - mean(0, 1) = -1/2 for the other (dr_grpo). The update's gradient is that one."""
    from agent_rl.config.file import load_config
    from agent_rl.learn.policy import build_policy, trainable_parameters
    from agent_rl.learn.update import policy_update

    cfg = load_config(None, [f"model.name={tiny_dir}", "model.lora_rank=8", "model.lora_alpha=16", "optim.lr=0.05",
                             "algorithm.advantage=dr_grpo", "rollout.tasks_per_step=1", "rollout.group_size=2"])
    torch.manual_seed(0)
    policy = build_policy(cfg.model, cfg.optim, tiny_dir)
    trajs = tree_rows(policy)
    adv = group_advantages([TrajectoryGroup("q", scored(trajs))], dr_grpo_advantages)
    assert list(adv.advantages) == pytest.approx([0.0, 1.0, -0.5], abs=1e-12)
    batch = collate(adv.trajectories, adv.advantages, 0)
    packing = pack_rows(batch.input_ids_B_T, batch.attention_mask_B_T)
    assert packing.input_ids_1_P.shape[1] == 27 and int(batch.loss_mask_B_T.sum()) == 23
    # by hand, on a copy of the weights before the step
    torch.manual_seed(0)
    hand = build_policy(cfg.model, cfg.optim, tiny_dir)
    loss = 0.0
    for t, a in zip(adv.trajectories, adv.advantages):
        x = torch.tensor([t.token_ids])
        logp = token_logprobs(hand.model, x, torch.ones_like(x)).logp_B_T[0]
        mask = torch.tensor(t.loss_mask[1:], dtype=logp.dtype)  # column t - 1 scores token t
        loss = loss - a * (logp[:-1] * mask).sum() / 23
    loss.backward()
    expected = torch.cat([p.grad.flatten() for p in trainable_parameters(hand.model)])
    policy_update(policy, batch, cfg.algorithm, cfg.optim, 1.0, seed=3)
    got = torch.cat([p.grad.flatten() for p in trainable_parameters(policy.model)])
    assert expected.abs().max() > 0
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_off_is_the_default_and_a_bad_budget_is_one_line():
    from agent_rl.config.file import load_config
    from agent_rl.core.config import ConfigError

    assert load_config(None, []).algorithm.tool_branches == 0.0
    with pytest.raises(ConfigError, match=r"algorithm\.tool_branches"):
        load_config(None, ["algorithm.tool_branches=1.5"])
    assert math.isclose(load_config(None, ["algorithm.tool_branches=0.25"]).algorithm.tool_branches, 0.25)


async def test_branches_play_on_rollout_workers_as_they_play_here(renderer, smol_dir, ray_local):
    """The same group on 2 Ray workers (the branch plans sent with their episodes): every episode and branch as
    played in this process."""
    import functools

    from agent_rl.rollout.worker import WorkerSettings
    from agent_rl.rollout.workers import rollout_workers

    here = await play(renderer, calculator_script(), budget=0.5)
    rule = BranchRule(0.5, tuple(renderer.call_opening()), token_text=lambda i: renderer.decode_raw([i]))
    local = ScriptedSampler(renderer, calculator_script())
    kit = functools.partial(branch_kit, str(smol_dir))
    async with rollout_workers(2, kit, local, LocalPlayers(CalculatorEnv, local, renderer), WorkerSettings()) as s:
        [there] = await play_groups(arithmetic_tasks(2)[1:2], Episodes(s.players, LIMITS, 4, branching=rule))
    assert [timeless(t) for t in there.trajectories] == [timeless(t) for t in here.trajectories]
    assert sum(t.branch is not None for t in there.trajectories) == 2


@pytest.mark.parametrize("name", ["qwen2_5", "qwen3", "llama3", "gemma3", "harmony"])
def test_every_family_opens_a_call_as_it_writes_one(request, name):
    """The forced opening is where the family's own call text begins, up to the tool's name: a turn that goes on
    from it as the family writes a call parses as that call."""
    from test_family_tokens import FAMILIES

    cls, tokenizer = FAMILIES[name]
    renderer = cls(request.getfixturevalue(tokenizer))
    opening = renderer.call_opening()
    call = ToolCall("calculator", {"expression": "6 * 7"})
    text = renderer.format_reply("", [call])
    assert opening and text.startswith(renderer.decode_raw(opening))
    [parsed] = renderer.parse([*renderer.encode_reply(text), renderer.stop_token_ids[0]]).tool_calls
    assert (parsed.name, parsed.arguments) == ("calculator", {"expression": "6 * 7"})


# -- the cold start from the policy's own episodes --------------------------------------------------------------


async def test_a_bootstrapped_demo_is_the_hint_free_render_with_the_assistant_tokens_masked_in(renderer):
    """A policy that calls the calculator only when the hint is in its prompt, or when a call's opening is forced:
    helped, it solves every task with the tool; each kept episode, replayed without the help, is the hint-free
    render of the same messages (its ids extend the environment's own prompt, token for token), and its mask marks
    exactly the assistant's turns, the forced opening included (in SFT it is a target)."""
    from agent_rl.bootstrap import Help, Helped, bootstrap
    from agent_rl.core.registry import load_env

    hint = "Always use the calculator."

    policy = calculator_script()

    def script(text: str) -> str:
        helped_to_call = hint in text and "<tool_response>" not in text
        return OPENING + policy(text + OPENING) if helped_to_call else policy(text)

    spec = load_env("calculator")
    tasks = spec.load_tasks(3, seed=0)
    sampler = ScriptedSampler(renderer, script)
    for help_ in (Help(hint=hint), Help(opening=tuple(renderer.call_opening()))):
        demos, stats = await bootstrap(spec, renderer, lambda make_env: LocalPlayers(make_env, sampler, renderer),
                                       tasks, 2, LIMITS, help_)
        assert stats == {"played": 6.0, "failed": 0.0, "attempted": 1.0, "solved": 1.0, "kept": 6.0, "diverged": 0.0,
                         "yield": 1.0}
        for demo in demos:
            async with spec.make_env(next(t for t in tasks if t["id"] == demo.task_id)) as env:
                prompt = renderer.render(await env.initial_messages(), env.tool_schemas)
            assert hint not in renderer.render_text(demo.token_ids)
            assert list(demo.token_ids[:len(prompt)]) == prompt  # the environment's own prompt, no help
            full = renderer.render(list(demo.messages), env.tool_schemas, add_generation_prompt=False)
            assert full[:len(demo.token_ids)] == list(demo.token_ids)
            assistant = {k for turn in demo.turns for k in range(turn.start, turn.end)}
            assert {k for k, m in enumerate(demo.loss_mask) if m} == assistant
            first = demo.turns[0]
            assert renderer.render_text(demo.token_ids[first.start:first.end]).startswith(OPENING)
    async with Helped(spec.make_env(tasks[0]), Help(hint=hint)) as helped:
        assert (await helped.initial_messages())[0].content.endswith("\n\n" + hint)


async def test_a_killed_bootstrap_goes_on_from_its_first_part_not_written(tmp_path):
    """`in_parts`: parts of 2 tasks; the figures are shares and counts over all parts (by hand); a run killed in its
    third part plays only that part again, and ends as an uninterrupted one; a parts file of other tasks is refused."""
    from agent_rl.bootstrap import in_parts

    tasks = [{"id": f"t{i}"} for i in range(5)]
    played: list[list[str]] = []

    async def part(some, fail_at=None):
        ids = [t["id"] for t in some]
        if ids == fail_at:
            raise KeyboardInterrupt  # killed while this part plays
        played.append(ids)
        kept = [i for i in ids if i != "t1"]  # t1's two episodes solve nothing; every other task's one of two
        return [f"demo {i}" for i in kept], {"played": 2.0 * len(ids), "failed": 0.0, "attempted": 1.0,
                                             "solved": len(kept) / (2 * len(ids)), "kept": float(len(kept)),
                                             "diverged": 0.0, "yield": len(kept) / (2 * len(ids))}

    whole = await in_parts(part, tasks, 2, tmp_path / "a.parts")
    assert played == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    assert whole == (["demo t0", "demo t2", "demo t3", "demo t4"],
                     {"played": 10.0, "kept": 4.0, "diverged": 0.0, "failed": 0.0, "attempted": 1.0, "solved": 0.4,
                      "yield": 0.4})
    played.clear()
    with pytest.raises(KeyboardInterrupt):
        await in_parts(lambda some: part(some, fail_at=["t4"]), tasks, 2, tmp_path / "b.parts")
    assert len((tmp_path / "b.parts").read_text().splitlines()) == 2  # the two parts that ended
    played.clear()
    assert await in_parts(part, tasks, 2, tmp_path / "b.parts") == whole and played == [["t4"]]
    with pytest.raises(ValueError, match=r"b.parts holds the parts of another bootstrap .*delete it to start afresh"):
        await in_parts(part, tasks[1:], 2, tmp_path / "b.parts")
