# What ran on the lent H200 machine on 2026-11-28 (one call, 357 s), from the repository root there, with
# .devcarry/ carried beside the tree: wheels the machine's image lacks (pydantic, pydantic-core, annotated-types,
# typing-inspection, jsonschema and its three needs), ray 2.60's cp312 wheel unpacked without its Java jars and
# rllib (an xz tarball: the wheel is over the 64 MiB a call carries), and the config and tokenizer files of
# smollm2-135m and qwen2.5-coder-0.5b (no weights). Its outputs are the files beside this one.
export PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
el setup
mkdir -p /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .devcarry/whl/*.whl 2>&1 | tail -2
tar xJf .devcarry/ray312.tar.xz -C /tmp/site
export PYTHONPATH=/tmp/site:$PWD
M=$PWD/.devcarry/models
{ nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader; nproc;
  grep -m1 'model name' /proc/cpuinfo; free -g | head -2; python3 -V;
  python3 -c "import torch, transformers, peft, aiohttp, pydantic, ray; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'peft', peft.__version__, 'aiohttp', aiohttp.__version__, 'pydantic', pydantic.VERSION, 'ray', ray.__version__)"
  python3 -c "import bench.runner_scale, bench.runner_workers, agent_rl.trainer; print('imports ok')"; } 2>&1 | tee $OUT/machine.txt
el gpu_trainer
timeout 200 python3 bench/gpu_trainer.py --model $M/smollm2-135m $M/qwen2.5-coder-0.5b --steps 4 > $OUT/gpu_trainer.json 2> $OUT/gpu_trainer.log
echo "rc=$?"; grep -v -E "Loading weights|Writing model" $OUT/gpu_trainer.log | tail -8; cat $OUT/gpu_trainer.json
el workers
timeout 190 python3 bench/runner_scale.py --workers 1 2 4 --servers 64 --concurrency 8192 --warmup 6 --window 10 --model $M/smollm2-135m > $OUT/workers.json 2> $OUT/workers.log
echo "rc=$?"; grep -E '^\{' $OUT/workers.log | tail -5; tail -3 $OUT/workers.log; cat $OUT/workers.json
el one_process
timeout 130 python3 bench/runner_scale.py --servers 64 --concurrency 4096 8192 --warmup 5 --window 10 --model $M/smollm2-135m > $OUT/one_process.json 2> $OUT/one_process.log
echo "rc=$?"; tail -4 $OUT/one_process.log; cat $OUT/one_process.json
el done
