"""Search QA on the real country articles: the answer judge, the dataset, episodes with the scripted
sampler (two-hop, wrong, hedged, malformed calls, bad rows), the solver on every question, and vLLM."""

from __future__ import annotations

import pytest

from agent_rl.core.types import Message
from agent_rl.envs.search_qa import (
    ARTICLE_CHARS,
    SearchQAEnv,
    articles,
    candidate_names,
    load_tasks,
    make_env,
    qa_dataset,
    solve,
    split_of,
)
from agent_rl.rewards.qa import MAX_ANSWER_WORDS, judge_answer, mentions, normalize
from agent_rl.rollout.runner import EpisodeLimits, run_episode
from agent_rl.tools.countries import country_triples, entity_key
from agent_rl.tools.search import SearchIndex

LIMITS = EpisodeLimits(max_turns=6, max_tokens_per_turn=256, max_total_tokens=4096)


@pytest.fixture(scope="module")
def index_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("search_qa") / "countries.sqlite"
    SearchIndex.build(path).close()
    return path


@pytest.fixture(scope="module")
def rows():
    return {r["question"]: r for split in ("train", "eval") for r in qa_dataset(split)}


# --- the answer judge ---


def test_normalize_makes_spellings_meet():
    assert normalize("Washington, D.C.") == normalize("washington dc") == "washington dc"
    assert normalize("St. George's") == normalize("Saint Georges") == "saint georges"
    assert normalize("N'Djamena") == normalize("NDJAMENA") and normalize("Bogotá") == "bogota"
    assert normalize("Latin America and the Caribbean") == "latin america and caribbean"


def test_judge_credits_one_right_name_and_nothing_hedged():
    capitals = ["Paris", "London", "Berlin", "Mexico City"]
    assert judge_answer("<answer>Paris</answer>", ["Paris"], capitals).exact
    said = judge_answer("The capital of France is Paris.", ["Paris"], capitals)
    assert said.correct and not said.exact
    assert judge_answer("The answer is paris", ["Paris"], capitals).exact
    for hedge in ["<answer>Paris, London</answer>", "Paris or Berlin", "London. No wait: Paris"]:
        verdict = judge_answer(hedge, ["Paris"], capitals)
        assert not verdict.correct and verdict.hedged and verdict.others, hedge
    assert not judge_answer("Berlin", ["Paris"], capitals).hedged  # wrong, not hedged
    assert not judge_answer("<answer>Paris</answer> <answer>London</answer>", ["Paris"], capitals).correct
    assert not judge_answer("<answer>Mexico City</answer>", ["Mexico"], capitals).correct  # not a word of a name
    assert not judge_answer('<tool_call>{"name": "search", "arguments": {"query": "Paris"}}</tool_call>',
                            ["Paris"], capitals).correct
    assert not judge_answer("", ["Paris"], capitals).correct
    # a bare JSON call (no tags) is a call, not an answer; several tags are no one answer, whichever comes last
    assert not judge_answer('{"name": "search", "arguments": {"query": "Paris"}}', ["Paris"], capitals).correct
    assert not judge_answer("<answer>London</answer>\n<answer>Paris</answer>", ["Paris"], capitals).correct


def test_a_copied_passage_is_not_an_answer(rows):
    # read_article("Iran") names Tehran and no other capital: pasted whole it once earned the reward
    capitals = candidate_names(rows["What is the capital of France?"]["answer_type"])
    title, body = articles()[entity_key("Iran")]
    article = f"{title}\n{body[:ARTICLE_CHARS]}"
    verdict = judge_answer(article, ["Tehran"], capitals)
    assert verdict.named and not verdict.others and verdict.passage and not verdict.correct
    sentence = "Having read the article about France, I can tell you that its capital city is Paris."
    assert len(sentence.split()) <= MAX_ANSWER_WORDS and judge_answer(sentence, ["Paris"], capitals).correct


def test_a_name_inside_a_longer_name_is_not_stated():
    subregions = ["Caribbean", "Latin America and the Caribbean", "South America"]
    assert mentions("Cuba is in Latin America and the Caribbean", subregions) == {"latin america and caribbean"}
    assert judge_answer("Latin America and the Caribbean", ["Latin America and the Caribbean", "Caribbean"],
                        subregions).correct
    assert not judge_answer("Caribbean", ["Latin America and the Caribbean", "South America"], subregions).correct


# --- the dataset ---


def test_splits_are_deterministic_disjoint_and_every_answer_is_a_graph_fact():
    train, eval_ = qa_dataset("train"), qa_dataset("eval")
    assert train.to_list() == qa_dataset("train").to_list() and len(train) + len(eval_) == 1690
    assert 0.15 < len(eval_) / 1690 < 0.25
    about = lambda ds: {r["facts"][0][0] for r in ds}  # noqa: E731  the country a question starts from
    assert not about(train) & about(eval_) and not set(train["question"]) & set(eval_["question"])
    assert all(split_of(c) == "eval" for c in about(eval_))
    facts = {tuple(t[:3]) for t in country_triples()}
    for row in train.to_list() + eval_.to_list():
        assert {tuple(f) for f in row["facts"]} <= facts and row["answer"] == row["facts"][-1][2]
        assert len(row["facts"]) == row["hops"] and row["answer"] not in row["aliases"]
    assert len(set(train["id"]) | set(eval_["id"])) == 1690
    assert {r["hops"] for r in train} == {1, 2}


def test_load_tasks_is_seeded_and_says_when_it_runs_out():
    tasks = load_tasks(5, seed=1)
    assert tasks == load_tasks(5, seed=1) != load_tasks(5, seed=2)
    assert all(t["id"].startswith("search-qa-") for t in tasks)
    assert {t["id"] for t in load_tasks(50, split="eval")}.isdisjoint({t["id"] for t in load_tasks(500)})
    with pytest.raises(ValueError, match="asked for 99999 tasks but the train split has"):
        load_tasks(99999)
    with pytest.raises(ValueError, match="split must be one of train, eval, got 'test'"):
        load_tasks(1, split="test")


def test_subregion_questions_accept_the_intermediate_region(rows):
    cuba = rows["Which subregion is Cuba in?"]
    assert cuba["answer"] == "Latin America and the Caribbean" and cuba["aliases"] == ["Caribbean"]


# --- episodes with the scripted sampler ---


async def test_two_hop_episode_reads_the_country_from_the_first_search(rows, index_path, scripted, renderer):
    task = rows["Which region is the country whose capital is Paris in?"]
    async with SearchQAEnv(task, index_path) as env:
        traj = await run_episode(env, scripted(lambda m: solve(task, m), on_messages=True),
                                 renderer, LIMITS, task["id"])
    assert traj.reward == 1.0, traj.messages[-1]
    assert traj.reward_parts == {"correct": 1.0, "exact": 1.0, "hedged": 0.0, "hops": 2.0, "tool_calls": 2.0,
                                 "tool_errors": 0.0, "grounded": 1.0}  # "Europe" stands in the second search's result
    first, second = (m.tool_calls[0] for m in traj.messages if m.tool_calls)
    assert first.arguments["query"] == "capital Paris" and "Its **capital** is **Paris**" in traj.messages[3].content
    assert second.arguments == {"query": "France is a country in", "k": 3}  # France: read off the first result
    assert traj.messages[-1].content == "<answer>Europe</answer>"


async def test_snippet_without_the_fact_opens_the_article(rows, index_path, scripted, renderer):
    task = rows["What currency is used in Laos?"]
    async with SearchQAEnv(task, index_path) as env:
        traj = await run_episode(env, scripted(lambda m: solve(task, m), on_messages=True),
                                 renderer, LIMITS, task["id"])
    assert traj.reward == 1.0 and [c.name for c in traj.tool_calls] == ["search", "read_article"]
    assert "LAK" not in traj.messages[3].content and "Currency: LAK." in traj.messages[5].content


async def test_wrong_and_hedged_answers_earn_nothing(rows, index_path, scripted, renderer):
    task = rows["What is the capital of France?"]
    for reply, hedged in [("<answer>Lyon</answer>", 0.0), ("<answer>Paris, Berlin, Madrid</answer>", 1.0),
                          ("It is Rome.", 0.0)]:
        async with SearchQAEnv(task, index_path) as env:
            traj = await run_episode(env, scripted(lambda p, r=reply: r), renderer, LIMITS, task["id"])
        assert traj.reward == 0.0 and traj.reward_parts["hedged"] == hedged and traj.tool_calls == ()
    async with SearchQAEnv(task, index_path) as env:  # the direct answer of the solver
        traj = await run_episode(env, scripted(lambda m: solve(task, m, direct=True), on_messages=True),
                                 renderer, LIMITS, task["id"])
    assert traj.reward == 1.0 and traj.reward_parts["tool_calls"] == 0.0


async def test_malformed_calls_get_error_messages_and_the_episode_goes_on(rows, index_path, scripted_calls, renderer):
    task = rows["Which region is the country whose capital is Paris in?"]
    bad = ['<tool_call>\n{"name": "search", "arguments": {"query": "Paris"\n</tool_call>',
           '<tool_call>\n{"name": "browse", "arguments": {"url": "x"}}\n</tool_call>',
           '<tool_call>\n{"name": "search", "arguments": {"query": "Paris", "k": 0}}\n</tool_call>',
           '<tool_call>\n{"name": "read_article", "arguments": {"title": "Frnace"}}\n</tool_call>']

    async with SearchQAEnv(task, index_path) as env:
        sampler = scripted_calls(bad, lambda m: solve(task, m))
        traj = await run_episode(env, sampler, renderer, EpisodeLimits(max_turns=8, max_total_tokens=4096), task["id"])
    errors = [m.content for m in traj.messages if m.role == "tool"][:4]
    assert errors[0].startswith("Error: tool call 1: malformed JSON")
    assert errors[1].startswith("Error: unknown tool 'browse'; available tools: search, read_article")
    assert errors[2] == "Error: k must be an integer from 1 to 20, got 0"
    assert errors[3].startswith("Error: no article titled 'Frnace'. Closest titles: France")
    assert traj.reward == 1.0 and traj.reward_parts["tool_errors"] == 4.0 and traj.reward_parts["tool_calls"] == 6.0


@pytest.mark.parametrize("change, message", [
    ({"answer": None}, "search_qa task 'bad-1' has no 'answer' column"),
    ({"question": ""}, "search_qa task 'bad-1': column 'question' must be a non-empty string, got ''"),
    ({"answer_type": "planet"}, "search_qa task 'bad-1': column 'answer_type' must be one of city, country,"),
    ({"aliases": "Paris"}, "search_qa task 'bad-1': column 'aliases' must be a list of strings, got 'Paris'"),
    ({"hops": "2"}, "search_qa task 'bad-1': column 'hops' must be a positive integer, got '2'"),
])
def test_malformed_row_names_the_row_and_the_column(rows, index_path, change, message):
    task = {**rows["What is the capital of France?"], "id": "bad-1", **change}
    task = {k: v for k, v in task.items() if v is not None}
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(")) as e:
        SearchQAEnv(task, index_path)
    assert "\n" not in str(e.value)


async def test_the_solver_answers_every_eval_question_and_a_sample_of_train(index_path):
    """Tool level, no tokenizer: each question's tool calls run for real and the solver reads the answers.
    (All 1690 questions pass too; 25 s on two busy cores, so the test takes 540 of them.)"""
    tasks = [*qa_dataset("eval"), *qa_dataset("train").shuffle(seed=0).select(range(200))]
    calls = {1: [], 2: []}
    for task in tasks:
        async with SearchQAEnv(task, index_path) as env:
            tools, messages = {t.name: t for t in env.tools}, [Message("user", task["question"])]
            for _ in range(6):
                reply = solve(task, messages)
                if not reply.tool_calls:
                    break
                call = reply.tool_calls[0]
                result = await tools[call.name].call(call.arguments)
                messages += [reply, Message("tool", result.content, name=call.name)]
            assert (await env.reward([reply])).value == 1.0, (task["question"], messages)
            calls[task["hops"]].append(sum(m.role == "tool" for m in messages))
    assert set(calls[1]) == {1, 2} and min(calls[2]) == 2 and max(calls[2]) <= 4


# --- the real server ---


@pytest.mark.integration
async def test_rollouts_against_vllm_keep_token_truth(play_on_server):
    limits = EpisodeLimits(max_turns=3, max_tokens_per_turn=48, max_total_tokens=2048)
    groups = await play_on_server(load_tasks(2, seed=0), make_env, limits)
    for t in (t for g in groups for t in g.trajectories):
        assert 0.0 <= t.reward <= 1.0 and set(t.reward_parts) >= {"correct", "hops", "tool_calls"}
