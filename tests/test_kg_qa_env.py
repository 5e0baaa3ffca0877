"""KG QA through the real knowledge-graph HTTP service: two-hop episodes with the scripted sampler,
wrong answers, malformed calls, bad rows, the per-process service, the solver on every question, and vLLM."""

from __future__ import annotations

import pytest

from agent_rl.core.types import Message
from agent_rl.envs.kg_qa import KGQAEnv, load_tasks, local_kg_url, make_env, solve
from agent_rl.envs.search_qa import qa_dataset
from agent_rl.rollout.runner import EpisodeLimits, run_episode
from agent_rl.tools.kg_service import KGStore, start_kg_service

LIMITS = EpisodeLimits(max_turns=8, max_tokens_per_turn=256, max_total_tokens=4096)


@pytest.fixture(scope="module")
async def kg_url(tmp_path_factory):
    path = tmp_path_factory.mktemp("kg_qa") / "kg.sqlite"
    KGStore.build(path).close()
    async with await start_kg_service(path) as service:
        yield service.url


@pytest.fixture(scope="module")
def rows(kg_url):
    """Two-hop questions by text, pointed at this module's service."""
    return {r["question"]: {**r, "kg_url": kg_url} for split in ("train", "eval") for r in qa_dataset(split, hops=2)}


async def test_two_hop_episode_follows_the_value_the_first_call_returned(rows, scripted, renderer):
    task = rows["What is the capital of the only country that borders Lesotho?"]
    async with KGQAEnv(task) as env:
        traj = await run_episode(env, scripted(lambda m: solve(task, m), on_messages=True),
                                 renderer, LIMITS, task["id"])
        assert env.client._session is not None  # the env's client talked to the service...
    assert env.client._session is None  # ...and leaving the env closed it
    assert traj.reward == 1.0 and traj.reward_parts == {"correct": 1.0, "exact": 1.0, "hedged": 0.0, "hops": 2.0,
                                                        "tool_calls": 2.0, "tool_errors": 0.0, "grounded": 1.0,
                                                        "empty_lookups": 0.0}
    first, second = (m.tool_calls[0] for m in traj.messages if m.tool_calls)
    assert first.arguments == {"entity": "Lesotho", "relation": "borders"}
    assert traj.messages[3].content == "Lesotho borders: South Africa [country]"
    assert second.arguments == {"entity": "South Africa", "relation": "capital"}  # read off the first answer
    assert traj.messages[-1].content == "<answer>Pretoria</answer>"


async def test_backward_hop_through_capital_of(rows, scripted, renderer):
    task = rows["Which subregion is the country whose capital is Ashgabat in?"]
    async with KGQAEnv(task) as env:
        traj = await run_episode(env, scripted(lambda m: solve(task, m), on_messages=True),
                                 renderer, LIMITS, task["id"])
    assert [m.content for m in traj.messages if m.role == "tool"] == [
        "Ashgabat capital_of: Turkmenistan [country]", "Turkmenistan subregion: Central Asia [subregion]"]
    assert traj.reward == 1.0


async def test_wrong_and_hedged_answers_earn_nothing(rows, scripted, renderer):
    task = rows["Which subregion is the country whose capital is Ashgabat in?"]
    for reply, hedged in [("<answer>Southern Asia</answer>", 0.0),
                          ("<answer>Central Asia or Western Asia</answer>", 1.0), ("Asia", 0.0)]:
        async with KGQAEnv(task) as env:
            traj = await run_episode(env, scripted(lambda p, r=reply: r), renderer, LIMITS, task["id"])
        assert traj.reward == 0.0 and traj.reward_parts["hedged"] == hedged
    async with KGQAEnv(task) as env:
        traj = await run_episode(env, scripted(lambda m: solve(task, m, direct=True), on_messages=True),
                                 renderer, LIMITS, task["id"])
    assert traj.reward == 1.0 and traj.tool_calls == ()


async def test_malformed_calls_get_error_messages_and_the_episode_goes_on(rows, scripted_calls, renderer):
    task = rows["What is the capital of the only country that borders Lesotho?"]
    bad = ['<tool_call>\n{"name": "follow", "arguments": {"entity": "Lesotho",}}\n</tool_call>',
           '<tool_call>\n{"name": "sparql", "arguments": {"query": "SELECT"}}\n</tool_call>',
           '<tool_call>\n{"name": "follow", "arguments": {"entity": "Lesotho"}}\n</tool_call>',
           '<tool_call>\n{"name": "follow", "arguments": {"entity": "Lesoto", "relation": "borders"}}\n</tool_call>']

    async with KGQAEnv(task) as env:
        traj = await run_episode(env, scripted_calls(bad, lambda m: solve(task, m)), renderer, LIMITS, task["id"])
    errors = [m.content for m in traj.messages if m.role == "tool"][:4]
    assert errors[0].startswith("Error: tool call 1: malformed JSON")
    assert errors[1] == "Error: unknown tool 'sparql'; available tools: search_entities, get_relations, follow"
    assert errors[2].startswith("Error: invalid arguments for follow: relation: Field required")
    assert errors[3].startswith("Error: No entity named 'Lesoto'. Closest names: Lesotho [country]")
    assert traj.reward == 1.0 and traj.reward_parts["tool_errors"] == 4.0 and traj.reward_parts["tool_calls"] == 6.0
    assert traj.reward_parts["empty_lookups"] == 1.0  # only 'Lesoto' reached the graph and found nothing


@pytest.mark.parametrize("change, message", [
    ({"question": None}, "kg_qa task 'bad-2' has no 'question' column"),
    ({"answer": 7}, "kg_qa task 'bad-2': column 'answer' must be a non-empty string, got 7"),
    ({"answer_type": ""}, "kg_qa task 'bad-2': column 'answer_type' must be a non-empty string, got ''"),
    ({"kg_url": "localhost:8090"}, "kg_qa task 'bad-2': column 'kg_url' must be an http(s) URL, got 'localhost:8090'"),
    ({"kg_empty_results": "empty"}, "kg_qa task 'bad-2': column 'kg_empty_results' must be one of explain, bare, "
                                    "got 'empty'"),
])
def test_malformed_row_names_the_row_and_the_column(rows, change, message):
    task = {**rows["Which subregion is the country whose capital is Ashgabat in?"], "id": "bad-2", **change}
    task = {k: v for k, v in task.items() if v is not None}
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)") + "$"):
        KGQAEnv(task)


def test_train_and_eval_tasks_are_two_hop_and_disjoint():
    train, eval_ = load_tasks(300, seed=0), load_tasks(100, seed=0, split="eval")
    assert train == load_tasks(300, seed=0) and all(t["hops"] == 2 and t["id"].startswith("kg-qa-") for t in train)
    assert not {t["facts"][0][0] for t in train} & {t["facts"][0][0] for t in eval_}
    with pytest.raises(ValueError, match="but the eval split has .* two-hop questions"):
        load_tasks(10_000, split="eval")


async def test_empty_results_arm_goes_from_load_tasks_to_the_tool(rows, scripted_calls, renderer):
    """`load_tasks(empty_results="bare")` (what `rollout.env_args` sets) reaches the episode's tools: a
    misspelt entity gets `[]`, where the default arm gets the explanation."""
    default, bare = load_tasks(2, seed=1), load_tasks(2, seed=1, empty_results="bare")
    assert [t["kg_empty_results"] for t in default] == ["explain"] * 2 and \
        [t["kg_empty_results"] for t in bare] == ["bare"] * 2
    assert [{**t, "kg_empty_results": "explain"} for t in bare] == default  # the same questions otherwise
    with pytest.raises(ValueError, match="kg_qa empty_results must be one of explain, bare"):
        load_tasks(2, empty_results="silent")
    task = rows["What is the capital of the only country that borders Lesotho?"]
    typo = ['<tool_call>\n{"name": "follow", "arguments": {"entity": "Lesoto", "relation": "borders"}}\n</tool_call>']
    said, reward, empty = {}, {}, {}
    for arm in ("explain", "bare"):
        async with KGQAEnv({**task, "kg_empty_results": arm}) as env:
            traj = await run_episode(env, scripted_calls(typo, lambda m: solve(task, m)), renderer, LIMITS, task["id"])
        said[arm], reward[arm] = [m.content for m in traj.messages if m.role == "tool"], traj.reward
        empty[arm] = traj.reward_parts["empty_lookups"]
    # the error says what went wrong and the solver retries; `[]` is a successful answer with
    # nothing in it, and the same solver concludes there is nothing to find
    assert said["explain"][0].startswith("Error: No entity named 'Lesoto'. Closest names: Lesotho [country]")
    assert said["bare"] == ["[]"] and reward == {"explain": 1.0, "bare": 0.0}
    assert empty == {"explain": 1.0, "bare": 1.0}  # counted in both arms, whatever the model was told


async def test_grounded_answers_name_only_what_a_tool_result_said(rows, scripted, renderer):
    """reward part `grounded`: the answer's names all appear in a successful tool result of the episode."""
    task = rows["What is the capital of the only country that borders Lesotho?"]
    cases = [  # (what the model says after the calls, grounded)
        ("<answer>Pretoria</answer>", 1.0),  # read off the second result
        ("The capital is Pretoria.", 1.0),  # a sentence around it is fine
        ("<answer>South Africa</answer>", 0.0),  # a tool said it, but it is no city: it names no candidate
        ("<answer>Maseru</answer>", 0.0),  # a city no tool said
        ("<answer>Pretoria or Maseru</answer>", 0.0),  # one name not from the tools
        ("<answer>I do not know</answer>", 0.0),  # names nothing
    ]
    for final, expected in cases:
        def script(messages, final=final):
            reply = solve(task, messages)
            return reply if reply.tool_calls else Message("assistant", final)

        async with KGQAEnv(task) as env:
            traj = await run_episode(env, scripted(script, on_messages=True), renderer, LIMITS, task["id"])
        assert traj.reward_parts["grounded"] == expected, final
    async with KGQAEnv(task) as env:  # the right answer with no tool call is not grounded
        traj = await run_episode(env, scripted(lambda m: solve(task, m, direct=True), on_messages=True), renderer,
                                 LIMITS, task["id"])
    assert traj.reward == 1.0 and traj.reward_parts["grounded"] == 0.0


async def test_without_a_url_every_env_shares_the_process_service(scripted, renderer):
    """Tasks as load_tasks gives them: the first env starts this process's service, the rest reuse it."""
    tasks = load_tasks(3, seed=5)
    assert all("kg_url" not in t for t in tasks)
    urls = set()
    for task in tasks:
        async with make_env(task) as env:
            traj = await run_episode(env, scripted(lambda m, t=task: solve(t, m), on_messages=True),
                                     renderer, LIMITS, task["id"])
        urls.add(env.client.url)
        assert traj.reward == 1.0 and traj.reward_parts["tool_calls"] == 2.0
    assert urls == {local_kg_url()}


async def test_the_solver_answers_every_two_hop_question(kg_url):
    """Tool level, no tokenizer: two `follow` calls per question against the service, then the answer."""
    tasks = [*qa_dataset("train", hops=2).to_list(), *qa_dataset("eval", hops=2).to_list()]
    assert len(tasks) == 716
    for task in tasks:
        async with KGQAEnv({**task, "kg_url": kg_url}) as env:
            tools, messages = {t.name: t for t in env.tools}, [Message("user", task["question"])]
            for _ in range(4):
                reply = solve(task, messages)
                if not reply.tool_calls:
                    break
                call = reply.tool_calls[0]
                result = await tools[call.name].call(call.arguments)
                messages += [reply, Message("tool", result.content, name=call.name)]
            assert sum(m.role == "tool" for m in messages) == 2
            assert (await env.reward([reply])).value == 1.0, (task["question"], messages)


@pytest.mark.integration
async def test_rollouts_against_vllm_keep_token_truth(play_on_server):
    limits = EpisodeLimits(max_turns=3, max_tokens_per_turn=48, max_total_tokens=2048)
    groups = await play_on_server(load_tasks(2, seed=0), make_env, limits)
    for t in (t for g in groups for t in g.trajectories):
        assert 0.0 <= t.reward <= 1.0 and t.reward_parts["hops"] == 2.0
