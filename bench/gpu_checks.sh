#!/usr/bin/env bash
# The GPU half of issue #32 (items 3 and 5) as one short run on a lent GPU machine (~8 min on one H200):
# the one-call varlen kernel against segment-by-segment attention (values and gradients), the trainer's
# step (MFU, peak memory; compiled whole layers and compiled parts, LoRA r16 with activation
# checkpointing, flex) against a bare loop, and the checkpoint's critical path against a bare safetensors
# write of the 1.5B shape. Logs go to $OUT (or ./gpu-checks). The machine's image has torch,
# transformers, peft, pyarrow; duckdb travels as a wheel in .whl/ (see the device README).
set -u
OUT=${OUT:-gpu-checks}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.log"
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" | tee -a "$OUT/device.log"
# the CUDA-only test, without pytest's conftest (it needs the OTel SDK, not on the image)
timeout 60 python3 - <<'PY' 2>&1 | tee "$OUT/varlen_check.log"
import importlib.util, inspect, trainer.attention as a
spec = importlib.util.spec_from_file_location("test_attention", "tests/trainer/test_attention.py")
t = importlib.util.module_from_spec(spec); spec.loader.exec_module(t)
try:
    from torch.nn.attention.varlen import varlen_attn
    print("torch varlen_attn", inspect.signature(varlen_attn))
except Exception as e:
    print("no torch varlen_attn:", e)
print("torch_varlen usable:", a.torch_varlen() is not None, "flash-attn:", a.flash_varlen() is not None)
if a.torch_varlen() is not None:
    t.test_one_varlen_call_matches_segment_by_segment_on_cuda("torch")
    print("varlen check: torch kernel matches segment-by-segment (values and gradients)")
PY
timeout 340 python3 bench/attention_memory.py --device cuda --quick \
  --configs full:ours:varlen:compile:profile,full:bare:varlen,lora:ours:varlen:ac:compile,full:ours:varlen:compile:parts,full:ours:flex:compile \
  2>&1 | grep -v Warning | tee "$OUT/attention.log"
timeout 120 python3 bench/checkpoint_save.py --hidden 1536 --layers 28 --vocab 151936 --device cuda --repeats 2 \
  --pair-only --dir /tmp 2>&1 | tee "$OUT/checkpoint.log"
