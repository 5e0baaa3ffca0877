"""What a server started for a run is asked to hold: a LoRA rank that fits the run's adapter."""

from __future__ import annotations

import json

import pytest

from agent_rl.config.file import load_config
from agent_rl.rollout.serving.base import ServerError
from agent_rl.rollout.serving.vllm.server import check_logprobs_mode, max_lora_rank


def model_cfg(**sets):
    return load_config(None, [f"model.{k}={v}" for k, v in sets.items()]).model


def test_the_rank_is_the_smallest_vllm_accepts_above_the_adapter(tmp_path):
    assert max_lora_rank(model_cfg()) == 16
    assert max_lora_rank(model_cfg(lora_rank=4)) == 8
    assert max_lora_rank(model_cfg(lora_rank=48)) == 64
    # a starting adapter of a higher rank than model.lora_rank: its own rank counts
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "adapter_config.json").write_text(json.dumps({"r": 64, "lora_alpha": 128}))
    assert max_lora_rank(model_cfg(lora_rank=16, init_adapter=tmp_path / "sft")) == 64
    with pytest.raises(ServerError, match=r"above the 512 vLLM can serve"):
        max_lora_rank(model_cfg(lora_rank=1024))


def test_an_unreadable_starting_adapter_is_one_line(tmp_path):
    with pytest.raises(ServerError) as e:
        max_lora_rank(model_cfg(init_adapter=tmp_path / "missing"))
    assert str(e.value).startswith("model.init_adapter: cannot read the adapter's rank from") and \
        "\n" not in str(e.value)


class FakeVLLM:
    """/v1/models and /v1/completions answering top-5 log-probs: of the distribution at the request's
    temperature (`processed`), or always at temperature 1 (raw)."""

    LOGITS = [2.0, 1.5, 1.0, 0.5, 0.0]

    def __init__(self, processed: bool):
        import http.server
        import math
        import threading

        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, obj):
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self.reply({"data": [{"id": "base", "parent": None}, {"id": "policy-v1", "parent": "base"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.models.append(body["model"])
                t = body["temperature"] if processed else 1.0
                scaled = [x / t for x in FakeVLLM.LOGITS]
                norm = math.log(sum(math.exp(x) for x in scaled))
                top = {f"tok{i}": x - norm for i, x in enumerate(scaled)}
                self.reply({"choices": [{"logprobs": {"top_logprobs": [top]}}]})

        self.models: list[str] = []
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("processed", [True, False])
def test_attached_servers_must_report_the_log_probs_they_sample_from(processed):
    fake = FakeVLLM(processed)
    try:
        check_logprobs_mode(fake.url, 1.0)  # at temperature 1 raw and processed agree: no probe
        assert fake.models == []
        if processed:
            check_logprobs_mode(fake.url, 0.7)
        else:
            with pytest.raises(ServerError) as e:
                check_logprobs_mode(fake.url, 0.7)
            assert str(e.value) == (f"vLLM server {fake.url} reports raw (pre-temperature) log-probs, but the run "
                                    "samples at temperature 0.7: start it with --logprobs-mode processed_logprobs, "
                                    "or sample at temperature 1")
        assert fake.models == ["base", "base"]  # the base model, not an adapter
    finally:
        fake.close()


@pytest.mark.integration
def test_the_test_server_reports_processed_log_probs(vllm_server):
    check_logprobs_mode(vllm_server.url, 0.7)
