"""Choosing the renderer of a model: by name, or automatically from its tokenizer.

Owns: `RENDERERS` (the known families by name), `detect` (a tokenizer's family), `get_renderer` and
`load_renderer` (from a model folder), and the one-line notice when the generic fallback is used.
A new family is one module beside `core.renderers.chatml` and one line in `RENDERERS` and `detect`.
It also sets a renderer's `bare_calls` switch from `model.bare_tool_calls` (families that have one).
Does not own: any family's format, the `Renderer` interface (`core.renderers.base`).

Automatic choice (`model.renderer: auto`), first match wins, from the tokenizer's special tokens and
chat template: `<|start_header_id|>` -> llama3; `<start_of_turn>` -> gemma3; `<|channel|>` ->
harmony (gpt-oss); `<|im_start|>` with a
`<think>` token -> qwen3; `<|im_start|>` with Qwen's default system prompt in the template ->
qwen2_5; `<|im_start|>` -> chatml; any other tokenizer with a chat template -> generic; none -> error.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from agent_rl.core.renderers.base import Renderer
from agent_rl.core.renderers.chatml import ChatMLRenderer, Qwen25Renderer
from agent_rl.core.renderers.gemma3 import Gemma3Renderer
from agent_rl.core.renderers.generic import GenericRenderer
from agent_rl.core.renderers.harmony import HarmonyRenderer
from agent_rl.core.renderers.llama3 import Llama3Renderer
from agent_rl.core.renderers.qwen3 import Qwen3NoThinkRenderer, Qwen3Renderer

RENDERERS: dict[str, type[Renderer]] = {
    r.name: r for r in (ChatMLRenderer, Qwen25Renderer, Qwen3Renderer, Qwen3NoThinkRenderer, Llama3Renderer,
                        Gemma3Renderer, HarmonyRenderer, GenericRenderer)
}
RENDERER_NAMES = ("auto", *RENDERERS)
GENERIC_NOTICE = "no built-in renderer for this tokenizer; using its chat template with prefix checks"
_noticed = False


def _has_token(tokenizer: Any, token: str) -> bool:
    ids = tokenizer.convert_tokens_to_ids([token])
    return bool(ids) and ids[0] is not None and ids[0] != tokenizer.unk_token_id


def detect(tokenizer: Any) -> str:
    """The family of a tokenizer (module doc); "generic" for an unknown one with a chat template."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):  # several named templates: look at them all
        template = " ".join(str(t) for t in dict(template).values())
    if _has_token(tokenizer, "<|start_header_id|>") and _has_token(tokenizer, "<|eot_id|>"):
        return "llama3"
    if _has_token(tokenizer, "<start_of_turn>") and _has_token(tokenizer, "<end_of_turn>"):
        return "gemma3"
    if _has_token(tokenizer, "<|channel|>") and _has_token(tokenizer, "<|start|>"):
        return "harmony"
    if _has_token(tokenizer, "<|im_start|>") and _has_token(tokenizer, "<|im_end|>"):
        if _has_token(tokenizer, "<think>"):
            return "qwen3"
        return "qwen2_5" if "You are Qwen, created by Alibaba Cloud" in template else "chatml"
    if template:
        return "generic"
    raise ValueError("no renderer for this tokenizer: it matches no known family and has no chat template "
                     f"(name one with model.renderer: {', '.join(RENDERERS)})")


def _notice_once() -> None:
    global _noticed
    if not _noticed:
        _noticed = True
        print(f"notice: {GENERIC_NOTICE}", file=sys.stderr)


def get_renderer(tokenizer: Any, name: str = "auto", bare_calls: bool | None = None) -> Renderer:
    """The renderer `name` on `tokenizer`; "auto" picks the family from the tokenizer. `bare_calls`
    (`model.bare_tool_calls`) switches the reading of tag-less JSON calls on or off; None keeps the
    family's default; a family without the switch refuses a value (one line naming the field)."""
    if name not in RENDERER_NAMES:
        raise ValueError(f"unknown renderer {name!r} (known: {', '.join(RENDERER_NAMES)})")
    if name == "auto":
        name = detect(tokenizer)
        if name == "generic":
            _notice_once()
    renderer = RENDERERS[name](tokenizer)
    if bare_calls is not None:
        if renderer.bare_calls is None:
            switchable = ", ".join(n for n, r in RENDERERS.items() if r.bare_calls is not None)
            raise ValueError(f"model.bare_tool_calls: the {name} renderer has no bare-call reading (it has: "
                             f"{switchable}); leave it unset (got {bare_calls})")
        renderer.bare_calls = bare_calls
    return renderer


def load_renderer(model_dir: str | Path, name: str = "auto", bare_calls: bool | None = None) -> Renderer:
    """The renderer for the tokenizer saved in a model folder."""
    from transformers import AutoTokenizer

    return get_renderer(AutoTokenizer.from_pretrained(str(model_dir)), name, bare_calls)
