#!/usr/bin/env bash
# One GPU lease (15 minutes of device time, starts included): the acceptance table in one call that ends
# inside DEADLINE_S, with room in the lease to run it again. Prepared for the device machine's bare CUDA image
# (torch, numpy, psutil, tiktoken, safetensors, transformers; no Prefect, MLflow or lm-eval). Carry reference/
# with the working tree (benchmarks/fetch_reference.sh fetches it); ../shared does not travel and is not needed.
#
#   bash benchmarks/gpu_lease.sh     # writes $OUT/gpu_check/{rows.json,gpu_check.log,env.txt,logs.tar.gz}
#   CALL=fp8 bash benchmarks/gpu_lease.sh    # one of the plan's calls (below); extra arguments go to gpu_check
#
# CALL: the lease plan, what no lease has measured first (issue 68; docs/training.md's pending table says which
# are still pending), each call sized to end inside a 570 s device call:
#   fp8         train.fp8=tensorwise vs bf16 at gpt2-1558m, 774m, then 124m (torchao's wheel carried in wheels/;
#               a size the deadline cuts is reported as such, the sizes before it keep their figures)
#   sustained   gpt2-124m's whole job for 3 minutes of steps with NVML sampled, then the out-of-memory row
#               (carry HellaSwag's validation file as wheels/hellaswag_val.jsonl for the real one)
#   family      gpt2-350m and 774m at their presets' own 524,288-token steps, 60 s of steps each
#   family-1558m  gpt2-1558m likewise (1,048,576-token steps: ~22 s each on one card, a call of its own)
#   reference   build-nanogpt against ours, 3 alternated rounds (AB BA AB)
#   acceptance  every other row of the default set (the reference has its own call)
#   default     gpu_check's default set (the CPU test's dry run; on a GPU the 3 reference rounds and the rest
#               exceed one call: the rows past BUDGET_S say "not run"; run reference, then acceptance)
#
# Rows run by value (gpu_check.py): the reference ratio (ABBA), the preset's train run and the time outside
# its steps, harness parity, then the rest, and a profile last where the ratio misses its target. BUDGET_S (default
# 440): no row starts after it. DEADLINE_S (default 520): any run still going is killed and its row FAILs, so the
# call ends by then plus the packing of the logs; rows.json and logs.tar.gz are rewritten after each row.
# Plan for an H100 (docs/training.md "The GPU lease"): a device call of timeout_s=570 within a 900 s lease
# (lease 6: the reference's rounds took 236-297 s, and every default row ~430-470 s in all).
set -uo pipefail
PY=${PYTHON:-python3}  # the GPU image has python3 (the one with torch), not always python
cd "$(dirname "$0")/.." || exit 2
case "${CALL:-default}" in
    fp8) rows=(--rows fp8) ;;
    sustained) rows=(--rows "sustained,oom") ;;
    family) rows=(--rows family --family "gpt2-350m:none,gpt2-774m:none") ;;
    family-1558m) rows=(--rows family --family gpt2-1558m:selective) ;;
    reference) rows=(--rows reference) ;;
    acceptance) rows=(--rows "train,harness,guards,micro-batch,resume,ranks,oom") ;;
    default) rows=() ;;
    *) echo "gpu_lease.sh: CALL=$CALL is not a call of the plan: fp8, sustained, family, family-1558m, reference," \
            "acceptance or default (see the top of this file)" >&2
       exit 2 ;;
esac
out=${OUT:-var}/gpu_check
mkdir -p "$out"
ref=${REFERENCE:-reference/build-nanogpt/train_gpt2.py}
# the fp8 row needs torchao, which the GPU image lacks: carry its wheel in wheels/ (on a machine with PyPI:
# pip download torchao==0.18.0 --no-deps -d wheels; 3.4 MB) and it is installed here, without its deps
for whl in "${WHEELS:-wheels}"/torchao-*.whl; do
    [ -f "$whl" ] || continue
    "$PY" -m pip install --quiet --no-deps "$whl" >&2 && echo "installed $(basename "$whl") (the fp8 row)" >&2
done
{
    date -u
    echo "python $("$PY" -c 'import sys; print(sys.version.split()[0])')"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
    "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"
    "$PY" -c "import torchao; print('torchao', torchao.__version__)" 2>/dev/null || echo "torchao: none (the fp8 row does not run)"
    echo "call ${CALL:-default}"
    "$PY" -m gptcore.launch accepts --shutdown-timeout && echo "torchrun has --shutdown-timeout" \
        || echo "torchrun has no --shutdown-timeout (left out)"
    echo "torchrun's flags: $("$PY" -m torch.distributed.run --help 2>&1 | grep -oE -- '--[a-z][a-z_-]+' | sort -u | tr '\n' ' ')"
    if [ -f "$ref" ]; then
        echo "reference $ref sha256 $(sha256sum "$ref" | cut -d' ' -f1) commit $(cat "$(dirname "$ref")/COMMIT" 2>/dev/null || echo unpinned)"
    else
        echo "reference: none ($ref missing): the stand-in runs"
    fi
} > "$out/env.txt" 2>&1
# the real HellaSwag validation file, where carried: the sustained row's evaluations score it (the device machine
# has no internet; gpu_check finds it where the pipeline caches it)
hs=${HELLASWAG_FILE:-${WHEELS:-wheels}/hellaswag_val.jsonl}
if [ -f "$hs" ]; then
    mkdir -p "${GPTPIPE_HOME:-var}/hellaswag"
    cp "$hs" "${GPTPIPE_HOME:-var}/hellaswag/hellaswag_val.jsonl"
    echo "HellaSwag: $hs ($(wc -l < "$hs") examples) carried" >&2
fi
refarg=()
if [ -f "$ref" ]; then refarg=(--reference "$ref"); else echo "no $ref: the reference row runs the stand-in" >&2; fi
"$PY" -m benchmarks.gpu_check "${refarg[@]}" --budget-s "${BUDGET_S:-440}" --deadline-s "${DEADLINE_S:-520}" \
    --logs "$out/logs.tar.gz" --out "$out/rows.json" "${rows[@]}" "$@" 2>&1 | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
