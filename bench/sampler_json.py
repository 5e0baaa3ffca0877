"""What a turn's JSON costs the sampler's client: the request written, the response read, by Python's json
(what VLLMSampler used until orjson) and by orjson (what it uses), side by side in one run.

A turn sends its whole context as token ids (`VLLMSampler._body`) and reads back its sampled ids, their
log-probs and the echoed prompt (`_json`, then `_completion`'s checks). Ids are drawn from SmolLM2's
vocabulary range; log-probs are random floats, as vLLM writes them (17 significant digits).

    python bench/sampler_json.py [--context 1000 8000] [--reply 260]
(one JSON line on stdout: microseconds a turn for each, and the ratios json / orjson)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_rl.rollout.sampler import SamplingParams, _body, _completion, _json


def stdlib_body(model: str, prompt_ids: list[int], params: SamplingParams) -> str:
    """The request as the standard library writes it (the same fields as `_body`)."""
    return json.dumps({"prompt": prompt_ids, "model": model, "max_tokens": params.max_tokens,
                       "temperature": params.temperature, "top_p": params.top_p, "logprobs": 0,
                       "return_token_ids": True, "skip_special_tokens": False,
                       "stop_token_ids": list(params.stop_token_ids), "seed": params.seed}, separators=(",", ":"))


def best_us(fn, number: int) -> float:
    """The best of 5 repeats, in microseconds a call."""
    return 1e6 * min(timeit.repeat(fn, number=number, repeat=5)) / number


def one(context: int, reply: int, rng: random.Random) -> dict[str, float]:
    prompt = [rng.randrange(49152) for _ in range(context)]
    ids = [rng.randrange(49152) for _ in range(reply)]
    response = json.dumps({"choices": [{"token_ids": ids, "finish_reason": "stop", "prompt_token_ids": prompt,
                                        "logprobs": {"token_logprobs": [-rng.expovariate(2) for _ in ids]}}]}).encode()
    params = SamplingParams(max_tokens=reply, stop_token_ids=(2,), seed=7)
    assert json.loads(_body("p", prompt, params)) == json.loads(stdlib_body("p", prompt, params))
    assert _json(response, "u") == json.loads(response)
    number = max(20, 200_000 // context)
    figures = {
        "write_json_us": best_us(lambda: stdlib_body("p", prompt, params), number),
        "write_orjson_us": best_us(lambda: _body("p", prompt, params), number),
        "read_json_us": best_us(lambda: json.loads(response), number),
        "read_orjson_us": best_us(lambda: _json(response, "u"), number),
        "checks_us": best_us(lambda: _completion(_json(response, "u"), prompt, 0, "u"), number)
        - best_us(lambda: _json(response, "u"), number),
    }
    figures = {k: round(v, 2) for k, v in figures.items()}
    return {"context": context, "reply": reply, **figures,
            "write_ratio": round(figures["write_json_us"] / figures["write_orjson_us"], 1),
            "read_ratio": round(figures["read_json_us"] / figures["read_orjson_us"], 1)}


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
