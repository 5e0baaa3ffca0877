"""What a turn's JSON costs the sampler's client: the request written, the response read and its echoed prompt
checked, by Python's json (what VLLMSampler used until orjson) and as VLLMSampler does it now, side by side.

A turn sends its whole context as token ids (`request_body`) and reads back its sampled ids, their
log-probs, its text and the echoed prompt, which must be the ids sent (`read_response`, then `response_completion`). The
standard library's side is `json.dumps`, `json.loads` and the ids compared; orjson's side reads the whole
response and compares the ids (`read_orjson_us`), and VLLMSampler's leaves out, unread, the token texts vLLM sends
with each log-prob and an echo that is the request's own JSON (compared as bytes), and reads the rest (`read_us`).
The response is written as vLLM 0.32 writes it (bench/shared/sim_responses.py's `response_json`). Ids are drawn from
SmolLM2's vocabulary range, each with a random text of 1-6 letters.

    python bench/sampler_json.py [--context 1000 8000] [--reply 260]
(one JSON line on stdout: microseconds a turn for each, and the ratios json / VLLMSampler's)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import orjson

from agent_rl.rollout.sampler import Completion, SamplingParams
from agent_rl.rollout.serving.vllm.sampler import read_response, request_body, response_completion
from bench.shared.sim_responses import response_json

VOCAB = 49152  # SmolLM2's


def stdlib_body(model: str, prompt_ids: list[int], params: SamplingParams) -> str:
    """The request as the standard library writes it (the same fields as `request_body`)."""
    return json.dumps({"prompt": prompt_ids, "model": model, "max_tokens": params.max_tokens,
                       "temperature": params.temperature, "top_p": params.top_p, "logprobs": 0,
                       "return_token_ids": True, "skip_special_tokens": False,
                       "stop_token_ids": list(params.stop_token_ids), "seed": params.seed}, separators=(",", ":"))


def best_us(fn, number: int) -> float:
    """The best of 5 repeats, in microseconds a call."""
    return 1e6 * min(timeit.repeat(fn, number=number, repeat=5)) / number


def one(context: int, reply: int, rng: random.Random) -> dict[str, float]:
    prompt = [rng.randrange(VOCAB) for _ in range(context)]
    ids = [rng.randrange(VOCAB) for _ in range(reply)]
    pieces = ["".join(rng.choice(" abcdefgh") for _ in range(rng.randint(1, 6))) for _ in range(VOCAB)]
    response = response_json(prompt, ids, pieces)
    params = SamplingParams(max_tokens=reply, stop_token_ids=(2,), seed=7)
    assert json.loads(request_body("p", orjson.dumps(prompt), params)) == json.loads(stdlib_body("p", prompt, params))

    def stdlib_read() -> Completion:
        return response_completion(json.loads(response), prompt, 0, "u")

    def orjson_read() -> Completion:
        return response_completion(orjson.loads(response), prompt, 0, "u")

    def sampler_read() -> Completion:
        return response_completion(read_response(response, "u", orjson.dumps(prompt)), prompt, 0, "u")

    assert stdlib_read() == orjson_read() == sampler_read()
    number = max(20, 200_000 // context)
    figures = {
        "write_json_us": best_us(lambda: stdlib_body("p", prompt, params), number),
        "write_us": best_us(lambda: request_body("p", orjson.dumps(prompt), params), number),
        "read_json_us": best_us(stdlib_read, number),
        "read_orjson_us": best_us(orjson_read, number),
        "read_us": best_us(sampler_read, number),
    }
    figures = {k: round(v, 2) for k, v in figures.items()}
    return {"context": context, "reply": reply, **figures,
            "write_ratio": round(figures["write_json_us"] / figures["write_us"], 1),
            "read_ratio": round(figures["read_json_us"] / figures["read_us"], 1),
            "read_orjson_ratio": round(figures["read_orjson_us"] / figures["read_us"], 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, nargs="+", default=[1000, 8000], help="prompt ids sent per turn")
    ap.add_argument("--reply", type=int, default=260, help="sampled ids per turn")
    args = ap.parse_args()
    rng = random.Random(0)
    rows = []
    for context in args.context:
        rows.append(one(context, args.reply, rng))
        print(rows[-1], file=sys.stderr)
    print(json.dumps({"bench": "sampler_json", "rows": rows}))


if __name__ == "__main__":
    main()
