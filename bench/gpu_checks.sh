#!/usr/bin/env bash
# The GPU half of issue #32 (items 3 and 5) as one short run on a lent GPU machine (~6 min on one H200):
# the trainer's step (MFU, peak memory; full weights and LoRA r16, with and without activation
# checkpointing) against a bare loop, the dataset step in fresh processes, the checkpoint save of the
# 1.5B shape against a bare safetensors write. Logs go to $OUT (or ./gpu-checks). The machine's image has
# torch, transformers, peft, pyarrow; duckdb travels as a wheel in .whl/ (see the device README).
set -u
OUT=${OUT:-gpu-checks}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.log"
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" | tee -a "$OUT/device.log"
timeout 330 python3 bench/attention_memory.py --device cuda --quick \
  --configs full:ours:varlen,full:bare:varlen,full:ours:varlen:ac,lora:ours:varlen,lora:ours:varlen:ac 2>&1 | tee "$OUT/attention.log"
timeout 120 python3 bench/dataset_step.py --repeats 2 2>&1 | grep -v Warning | tee "$OUT/dataset_step.log"
timeout 200 python3 bench/checkpoint_save.py --hidden 1536 --layers 28 --vocab 151936 --device cuda --repeats 2 \
  --dir /tmp 2>&1 | tee "$OUT/checkpoint.log"
