#!/usr/bin/env bash
# One GPU lease (15 minutes of device time, starts included): the whole acceptance table in one call, with
# room to run it again. Prepared for the device machine's bare CUDA image (torch, numpy, psutil, tiktoken,
# safetensors, transformers; no Prefect, MLflow or lm-eval). Carry reference/ with the working tree
# (benchmarks/fetch_reference.sh fetches it); ../shared does not travel and is not needed.
#
#   bash benchmarks/gpu_lease.sh            # writes $OUT/gpu_check/{rows.json,gpu_check.log,env.txt}
#
# BUDGET_S (default 330) is gpu_check's --budget-s: no row starts after it, so the call ends within a
# few minutes of it even when a row is slow; rows.json is rewritten after each row.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-var}/gpu_check
mkdir -p "$out"
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
    python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
    python -m gptcore.launch accepts --shutdown-timeout && echo "torchrun has --shutdown-timeout" \
        || echo "torchrun has no --shutdown-timeout (left out)"
} > "$out/env.txt" 2>&1
ref=reference/build-nanogpt/train_gpt2.py
refarg=()
if [ -f "$ref" ]; then refarg=(--reference "$ref"); else echo "no $ref: the reference row runs the stand-in" >&2; fi
python -m benchmarks.gpu_check "${refarg[@]}" --budget-s "${BUDGET_S:-330}" --out "$out/rows.json" 2>&1 \
    | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
