"""Choosing the renderer of a model: by name, or automatically from its tokenizer.

Owns: `RENDERERS` (the known families by name), `get_renderer` and `load_renderer` (from a model
folder). A new family is one module beside `core.chatml` and one line here.
Does not own: any family's format, the `Renderer` interface (`core.renderer`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent_rl.core.chatml import ChatMLRenderer
from agent_rl.core.renderer import Renderer

RENDERERS: dict[str, type[Renderer]] = {"chatml": ChatMLRenderer}


def get_renderer(tokenizer: Any, name: str = "auto") -> Renderer:
    """The renderer `name` on `tokenizer`; "auto" picks the family from the tokenizer."""
    if name == "auto":
        name = "chatml"
    if name not in RENDERERS:
        raise ValueError(f"unknown renderer {name!r} (known: {', '.join(RENDERERS)}, auto)")
    return RENDERERS[name](tokenizer)


def load_renderer(model_dir: str | Path, name: str = "auto") -> Renderer:
    """The renderer for the tokenizer saved in a model folder."""
    from transformers import AutoTokenizer

    return get_renderer(AutoTokenizer.from_pretrained(str(model_dir)), name)
