"""ChatML with Qwen2.5-style tool blocks: the format of SmolLM2, Qwen2.5 and other ChatML models.

Owns: `ChatMLRenderer` (rendering and parsing this family: tool schemas in the system turn,
`<tool_call>{json}</tool_call>` blocks in assistant turns, results in `<tool_response>` blocks) and
`Qwen25Renderer`, the same with Qwen2.5's default system prompt: token for token the official
Qwen2.5 chat template (tests/test_renderers.py). Both read calls written without their tags too when
`bare_calls` is on (`core.renderers.toolcalls.parse_bare_calls`; `model.bare_tool_calls`): off by default for
ChatML, on for Qwen2.5, whose small instruct models answer a tool prompt with bare JSON calls.
Does not own: the renderer interface (`core.renderers.base`), the `<tool_call>` JSON parser it shares
with other Hermes-style families (`core.renderers.toolcalls`), or deciding what the messages are (`envs`).

Format (structural tokens by id, text segments through the tokenizer):

    <|im_start|>system\n{system}\n\n# Tools ... <tools>{schemas}</tools> ...<|im_end|>\n
    <|im_start|>user\n{question}<|im_end|>\n
    <|im_start|>assistant\n{sampled text, may hold <tool_call>{json}</tool_call>}<|im_end|>\n
    <|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n     (tool messages)
    <|im_start|>assistant\n

Consecutive tool messages share one user turn, as Qwen2.5 renders them, so hub models trained on
that format read it natively. Message text is encoded with special tokens split, so a tool output or
a user that writes "<|im_end|>" gets plain-text tokens and cannot forge a turn boundary.

Incremental rendering: the policy samples an assistant turn ending in <|im_end|>; the environment's
reply is appended as `continuation(messages)` = "\n" + rendered messages + generation prompt. For
canonically tokenised replies, initial prompt + samples + continuations == `render(all messages)`,
which the tests check; for anything the policy samples, the sampled ids are kept as they are.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from agent_rl.core.renderers.base import Renderer
from agent_rl.core.renderers.toolcalls import parse_bare_calls, parse_tool_calls
from agent_rl.core.types import Message, ToolCall

TOOLS_PREAMBLE = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
DEFAULT_SYSTEM = "You are a helpful assistant."


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The text of one tool call as the policy should write it."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


class ChatMLRenderer(Renderer):
    """Renders ChatML conversations to token ids with one tokenizer, and parses sampled turns."""

    name = "chatml"
    default_system = DEFAULT_SYSTEM  # the system turn when the conversation has none
    bare_calls = False  # a reply of bare JSON calls, without <tool_call> tags, is read as those calls

    def __init__(self, tokenizer: Any):
        super().__init__(tokenizer)
        self.im_start = self.special_id("<|im_start|>")
        self.im_end = self.special_id("<|im_end|>")
        # constant pieces, tokenised once: rendering runs at every turn of every rollout
        self.newline = self.encode("\n")
        self.generation_prompt = [self.im_start, *self.encode("assistant\n")]

    @property
    def stop_token_ids(self) -> list[int]:
        return [self.im_end]

    def parse_tool_calls(self, text: str) -> list[ToolCall]:
        calls = parse_tool_calls(text)
        return parse_bare_calls(text) if not calls and self.bare_calls else calls

    def format_reply(self, content: str, tool_calls: Sequence[ToolCall] = ()) -> str:
        calls = "\n".join(format_tool_call(c.name, c.arguments) for c in tool_calls)
        return "\n".join(part for part in (content, calls) if part)

    def _turn(self, role: str, text: str) -> list[int]:
        # cached: the system turn is the same in every episode, a group's rollouts share the question and often
        # a tool's result (`Renderer.encode_cached`)
        return [self.im_start, *self.encode_cached(f"{role}\n{text}"), self.im_end]

    # -- messages ----------------------------------------------------------------------------
    def system_text(self, system: str | None, tools: Sequence[dict[str, Any]]) -> str | None:
        """The system turn's text (None: no system turn)."""
        text = system if system is not None else self.default_system
        if tools:
            schemas = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
            text += TOOLS_PREAMBLE + schemas + TOOLS_POSTAMBLE
        return text

    def _render_messages(self, messages: Sequence[Message]) -> list[int]:
        """Messages after the system turn, each turn closed by <|im_end|> and the newline after it."""
        ids: list[int] = []
        i = 0
        while i < len(messages):
            m = messages[i]
            if m.role == "tool":
                block = []
                while i < len(messages) and messages[i].role == "tool":
                    block.append(f"<tool_response>\n{messages[i].content}\n</tool_response>")
                    i += 1
                ids += self._turn("user", "\n".join(block)) + self.newline
                continue
            if m.role == "assistant":
                ids += [*self.generation_prompt, *self.encode(m.content), self.im_end]
                ids += self.newline
            elif m.role in ("user", "system"):
                ids += self._turn(m.role, m.content) + self.newline
            else:
                raise ValueError(f"unknown message role {m.role!r}")
            i += 1
        return ids

    def render(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] = (),
               add_generation_prompt: bool = True) -> list[int]:
        """A whole conversation; the first message may be the system prompt."""
        system = None
        if messages and messages[0].role == "system":
            system, messages = messages[0].content, messages[1:]
        text = self.system_text(system, tools)
        ids = [] if text is None else self._turn("system", text) + self.newline
        ids += self._render_messages(messages)
        return ids + self.generation_prompt if add_generation_prompt else ids

    def continuation(self, messages: Sequence[Message], after_stop: bool = True) -> list[int]:
        """Ids to append after a sampled assistant turn: close it, add `messages`, prompt again.

        `after_stop` is False when the sampled turn did not end with <|im_end|> (a stop string):
        the delta then closes the turn itself.
        """
        if any(m.role in ("assistant", "system") for m in messages):
            raise ValueError("an environment may only add user or tool messages between turns")
        head = self.newline if after_stop else [self.im_end, *self.newline]
        return head + self._render_messages(messages) + self.generation_prompt


class Qwen25Renderer(ChatMLRenderer):
    """Qwen2.5 (and Qwen2.5-Coder): ChatML with Qwen's own default system prompt."""

    name = "qwen2_5"
    default_system = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    bare_calls = True  # Qwen2.5-Coder-0.5B-Instruct writes most of its calls bare (docs/coding-recipe.md)
