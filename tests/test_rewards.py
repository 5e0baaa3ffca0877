"""Reward functions: answer extraction and math-verify equivalence, format checks, rubrics.

Equivalence cases are worked out by hand: each pair either must hold or must not.
"""

from __future__ import annotations

import asyncio
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from agent_rl.rewards.answers import (
    answer_span,
    correct_answer,
    is_number_list,
    math_answer,
    math_equal,
    numeric_answer,
)
from agent_rl.rewards.code import extract_code
from agent_rl.rewards.format import no_tool_markup, single_answer, tags_closed, used_tools
from agent_rl.rewards.rubric import RewardError, RewardTerm, Rubric, final_reply

MUST_HOLD = [
    ("The answer is 84.", "84"),
    ("So 12 + 30 = 42, times 2 is 84.", "84"),  # reasoning before the answer on the same line
    ("12 + 30 = 42\n42 * 2 = 84\nThe answer is 84.\nHope that helps!", "84"),  # last line with a digit
    ("\\boxed{84}", "84"),
    ("\\boxed{84.0}", "84"),
    ("<answer>84</answer>", "84"),
    ("<answer>84 dollars</answer>", "84"),  # trailing unit words are dropped
    ("The answer is 1,234 apples", "1234"),
    ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("\\boxed{\\dfrac12}", "0.5"),
    ("<answer>0.5</answer>", "1/2"),
    ("<answer>1/2</answer>", "\\frac{1}{2}"),
    ("The answer is $\\frac{1}{2}$.", "0.5"),
    ("\\boxed{3\\sqrt{2}}", "\\sqrt{18}"),
    ("\\boxed{\\dfrac12}", "1/2"),
    ("The answer is -84.", "-84"),
    ("<answer>3/4</answer>", "0.75"),
    ("x = 84", "84"),
    ("I first thought \\boxed{80}, but it is \\boxed{84}", "84"),  # the last boxed counts
    ("\\boxed{1, 2}", "1, 2"),  # a list answer is fine when the reference is a list
]
MUST_NOT_HOLD = [
    ("It is 80.", "84"),
    ("84", "-84"),
    ("\\boxed{\\frac{1}{3}}", "0.33"),
    ("0.333", "1/3"),
    ("The answer is 84.", "8"),
    # hedging over several numbers earns nothing, even when one of them is right
    ("82, 83, 84", "84"),
    ("84 or 85 or 86", "86"),
    ("The answer is 42 and 84", "84"),
    ("$84$ $85$", "85"),
    ("\\boxed{82, 83, 84}", "84"),
    ("<answer>83 84</answer>", "84"),
    # the tag wins over a right number elsewhere
    ("84 <answer>85</answer>", "84"),
    # a reply that is a tool call is not an answer
    ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "84"}}\n</tool_call> 84', "84"),
    ("<answer>" + "well " * 80 + "84</answer>", "84"),  # an essay in the answer tag
    ("no digits at all", "84"),
    # a numeric reference must be stated as a number: unevaluated arithmetic is no answer, however
    # it evaluates (else copying "(123 + 456) * 7" from the question would earn the reward)
    ("(123 + 456) * 7", "4053"),
    ("\\boxed{(123 + 456) \\cdot 7}", "4053"),
    ("The answer is 4000 + 53", "4053"),
    ("\\boxed{2^{10}}", "1024"),
    ("\\boxed{\\sqrt{16}}", "4"),
    ("91/7", "13"),  # a fraction counts only in lowest terms
    ("\\boxed{\\frac{2}{4}}", "0.5"),
    ("5 -84", "-84"),
    # look-alike digits read as numbers to Python, not to whoever consumes the answer
    ("４０５３", "4053"),
    ("The answer is ٤٠٥٣.", "4053"),
    ("\\boxed{𝟒𝟎𝟓𝟑}", "4053"),
]


@pytest.mark.parametrize(("text", "gold"), MUST_HOLD)
def test_equivalences_that_must_hold(text, gold):
    assert math_answer(text, gold) == 1.0, answer_span(text)


@pytest.mark.parametrize(("text", "gold"), MUST_NOT_HOLD)
def test_equivalences_that_must_not_hold(text, gold):
    assert math_answer(text, gold) == 0.0, answer_span(text)


def test_answer_span_takes_one_candidate():
    assert answer_span("<answer>7</answer> and \\boxed{8}") == "7"  # the tag before \boxed
    assert answer_span("first \\boxed{\\frac{1}{2}} then \\boxed{\\frac{3}{4}}") == "$\\frac{3}{4}$"
    assert answer_span("Working: 3 + 4 = 7\nSo the total is 7 apples.\nDone!") == "So the total is 7 apples."
    assert answer_span("\\boxed{ 12. }") == "12"
    assert answer_span("<tool_call>{}</tool_call>") is None and answer_span("") is None
    assert answer_span("a " * 400 + "99")[-2:] == "99" and len(answer_span("a " * 400 + "99")) <= 300


async def test_a_call_is_no_answer_tagged_or_bare_and_several_tags_are_none():
    # the answer only in a call's arguments, written with or without the tags (Qwen2.5's small models
    # drop them): no answer, whether the renderer read the bare JSON as a call or not
    bare = '{"name": "calculator", "arguments": {"expression": "27"}}'
    fenced = '```json\n{"name": "calculator", "arguments": {"expression": "27"}}\n```'
    assert answer_span(bare) is None and answer_span(fenced) is None
    assert await correct_answer([bare, fenced, "It is 27."], [27, 27, 27]) == [0.0, 0.0, 1.0]
    assert numeric_answer(bare, 27) == 0.0 and extract_code('{"name": "python", "arguments": {"code": "x"}}') is None
    # several answer tags: no one answer (a flood of tagged candidates cut by the token budget ends on any)
    assert answer_span("<answer>26</answer>\n<answer>27</answer>") is None
    assert answer_span("<answer>27</answer>") == "27"


def test_number_lists_are_recognised():
    for listed in ["1, 2, 3", "84 or 85", "84 and 85", "$4$ $5$", "4;5", "4 \\quad 5", "84,85"]:
        assert is_number_list(listed), listed
    for single in ["84", "1,234", "12 + 30 = 42", "\\frac{1}{2}", "2^{10}", "-3", "so 42, times 2 is 84"]:
        assert not is_number_list(single), single


def test_math_equal_cannot_hang():
    """sympy would expand 10^(10^10) for minutes (SIGALRM cannot stop it): the worker is killed."""
    assert math_equal("$\\frac{1}{2}$", "0.5")  # the worker is up
    start = time.monotonic()
    assert math_equal("$10^{10^{10}}$", "84", timeout_s=1.0) is False
    assert time.monotonic() - start < 3.0
    assert math_equal("$\\frac{1}{2}$", "0.5")  # a fresh worker takes over


def test_math_equal_works_from_threads():
    texts = ["\\boxed{\\frac{1}{\\sqrt{2}}}", "\\boxed{\\frac{\\sqrt{2}}{2}}", "\\boxed{\\sqrt{3}}",
             "The answer is $\\sqrt{0.5}$"] * 2
    with ThreadPoolExecutor(4) as pool:  # a symbolic reference: math-verify's worker decides
        scores = list(pool.map(lambda t: math_answer(t, "\\frac{\\sqrt{2}}{2}"), texts))
    assert scores == [1.0, 1.0, 0.0, 1.0] * 2


async def test_correct_answer_is_an_async_trl_reward():
    completions = [[{"role": "assistant", "content": f"\\boxed{{\\frac{{{k}\\pi}}{{4}}}}"}] for k in range(4)]
    results = await asyncio.gather(*(correct_answer([c], ["\\pi/2"]) for c in completions))
    assert results == [[0.0], [0.0], [1.0], [0.0]]  # math-verify's worker, from the event loop
    assert await correct_answer(["\\boxed{3}", "\\boxed{4}"], ["3", "3"]) == [1.0, 0.0]


# -- format checks ---------------------------------------------------------------------------------
def _conv(*contents: str, tool: bool = False) -> list[dict]:
    msgs = [{"role": "assistant", "content": c} for c in contents]
    if tool:
        msgs.insert(1, {"role": "tool", "name": "calculator", "content": "84"})
    return msgs


def test_single_answer():
    ok = [_conv("The answer is \\boxed{84}."), _conv("<answer>84</answer>"), _conv("It is 84.")]
    bad = [_conv("\\boxed{84} or \\boxed{85}"), _conv("<answer>1</answer><answer>2</answer>"),
           _conv("82, 83, 84"), _conv("I don't know."), _conv('<tool_call>{"name": "x"}</tool_call>')]
    assert single_answer(ok + bad) == [1.0] * len(ok) + [0.0] * len(bad)


def test_no_tool_markup_and_tags_closed():
    assert no_tool_markup([_conv("84"), _conv("<tool_response>84</tool_response> so 84"),
                           _conv("<tool_call>\n{}")]) == [1.0, 0.0, 0.0]
    call = '<tool_call>\n{"name": "calculator", "arguments": {}}\n</tool_call>'
    assert tags_closed([_conv(call, "<answer>84</answer>", tool=True), _conv("<think>hm</think> 84")]) == [1.0, 1.0]
    for broken in ["<answer>84", "84</answer>", "<think><think>x</think></think>", "<tool_call>\n{}"]:
        assert tags_closed([_conv(broken)]) == [0.0], broken
    assert tags_closed([_conv("<tool_call>\n{}", "84")]) == [0.0]  # an earlier turn counts too


def test_used_tools_and_final_reply():
    assert used_tools([_conv("a", "84", tool=True), _conv("84"), "84"]) == [1.0, 0.0, 0.0]
    assert final_reply(_conv("a", "b", tool=True)) == "b"
    assert final_reply([{"role": "assistant", "content": "x"}, {"role": "tool", "content": "1"}]) == ""
    assert final_reply("plain") == "plain"


# -- rubric ----------------------------------------------------------------------------------------
def format_reward(completions, **kwargs):
    """As TRL's documentation writes a reward function: a format check on the first message."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def reward_ground_truth(completions, ground_truth, **kwargs):
    """TRL's documented example of a reward reading a dataset column."""
    matches = [re.search(r"\\boxed\{(.*?)\}", completion[0]["content"]) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


async def length_penalty(completions, **kwargs):
    await asyncio.sleep(0)
    return [-len(c[-1]["content"]) / 100 for c in completions]


async def test_rubric_weights_parts_and_trl_functions():
    rubric = Rubric([(reward_ground_truth, 1.0), (format_reward, 0.5), (length_penalty, 0.0),
                     RewardTerm(lambda completions, **kw: [2.0], 0.0, "constant")])
    prompt = [{"role": "user", "content": "What is 2 + 2?"}]
    good = [{"role": "assistant", "content": "<think>2 + 2</think><answer>\\boxed{4}</answer>"}]
    score = await rubric.score(prompt, good, ground_truth="4", id="t1")
    assert score.parts == {"reward_ground_truth": 1.0, "format_reward": 1.0, "length_penalty": -0.46,
                           "constant": 2.0}
    assert score.total == 1.5  # weight-0 parts are metrics only
    wrong = [{"role": "assistant", "content": "\\boxed{5}"}]
    score = await rubric.score(prompt, wrong, ground_truth="4")
    assert (score.total, score.parts["reward_ground_truth"], score.parts["format_reward"]) == (0.0, 0.0, 0.0)


async def test_rubric_passes_trl_arguments_as_lists():
    seen = {}

    def spy(prompts, completions, answer, **kwargs):
        seen.update(prompts=prompts, completions=completions, answer=answer, **kwargs)
        return [0.0]

    prompt, completion = [{"role": "user", "content": "q"}], [{"role": "assistant", "content": "a"}]
    await Rubric([(spy, 1.0)]).score(prompt, completion, answer="7", id="r1")
    assert seen == {"prompts": [prompt], "completions": [completion], "answer": ["7"], "id": ["r1"]}


@pytest.mark.parametrize(("fn", "message"), [
    (lambda completions, **kw: [1.0, 0.0], "returned 2 values for 1 completion"),
    (lambda completions, **kw: [None], "returned None, not a number"),
    (lambda completions, **kw: ["1"], "returned '1', not a number"),
    (lambda completions, **kw: 1.0, "must return a list with one number per completion"),
    (lambda completions, **kw: [float("nan")], "not a finite number"),
    (lambda completions: [1.0], "raised TypeError"),  # not TRL-style: no **kwargs
    (lambda completions, **kw: [1 / 0], "raised ZeroDivisionError"),
])
async def test_rubric_names_the_function_that_misbehaves(fn, message):
    rubric = Rubric([RewardTerm(fn, 1.0, "my_reward")])
    with pytest.raises(RewardError, match=f"reward function 'my_reward' .*{re.escape(message)}"):
        await rubric.score([{"role": "user", "content": "q"}], [{"role": "assistant", "content": "a"}], x=1)


def test_rubric_rejects_unnamed_and_duplicate_functions():
    with pytest.raises(ValueError, match="no usable name"):
        Rubric([(lambda completions, **kw: [1.0], 1.0)])
    with pytest.raises(ValueError, match=r"duplicate reward names \['format_reward'\]"):
        Rubric([(format_reward, 1.0), (format_reward, 0.0)])
    with pytest.raises(ValueError, match="weight must be a finite number"):
        Rubric([(format_reward, float("inf"))])
