"""A policy for the branching tests, importable by rollout workers (`ray_local` puts tests/ on their path).

Owns: `calculator_script` (a scripted policy on the calculator environment that never calls the calculator unless
a call's opening was forced, or that calls it wrong unless its reasoning was kept for it) and `branch_kit` (that
policy as a rollout worker's kit).
"""

from __future__ import annotations

import re

from agent_rl.core.renderers.choose import load_renderer
from agent_rl.envs.calculator import CalculatorEnv
from agent_rl.rollout.scripted import ScriptedSampler
from agent_rl.rollout.worker import Kit

OPENING = '<tool_call>\n{"name": "'


def calculator_script(opening: str = OPENING, wrong_call: bool = False):
    """A policy that never calls the calculator and answers 0, unless a call's opening was forced (it then finishes
    the call on the task's expression); after a tool's result it gives that result. With `wrong_call` it reasons,
    then calls the calculator on 1 + 1, unless its reasoning was kept for it (then it calls it on the expression)."""

    def script(text: str) -> str:
        expression = re.search(r"What is (.*)\?", text).group(1)
        if "<tool_response>" in text.rsplit("<|im_start|>user", 1)[-1]:
            result = text.rsplit("<tool_response>", 1)[1].split("</tool_response>")[0].strip()
            return f"The answer is {result}."
        if text.endswith(opening):
            return f'calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'
        if wrong_call:
            right = text.endswith("Let me compute.\n")
            call = '{"name": "calculator", "arguments": {"expression": "%s"}}' % (expression if right else "1 + 1")
            return ("" if right else "Let me compute.\n") + f"<tool_call>\n{call}\n</tool_call>"
        return "The answer is 0."

    return script


def branch_kit(model_dir: str, wrong_call: bool = False) -> Kit:
    renderer = load_renderer(model_dir)
    return Kit(CalculatorEnv, renderer, ScriptedSampler(renderer, calculator_script(wrong_call=wrong_call)))
