#!/usr/bin/env bash
# The GPU checks in one short run (about 9 minutes on one H200), for a machine that has PyTorch with
# CUDA but nothing of tlt installed: the CUDA tests, then the speculative, rollout and end-to-end
# benchmarks on the GPU. Logs and JSON go to $OUT (default runs/gpu).
#   scripts/gpu_check.sh [all]               everything
#   scripts/gpu_check.sh tests               the CUDA tests only
#   scripts/gpu_check.sh tests rollout_bf16  the named parts, run in the script's order; the parts are
#                                            tests, speculative, rollout, rollout_bf16 and e2e
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
parts=" ${*:-all} "
[[ $parts == " all " ]] && parts=" tests speculative rollout rollout_bf16 e2e "
for part in $parts; do
    case $part in tests|speculative|rollout|rollout_bf16|e2e) ;; *) echo "unknown part '$part'" >&2; exit 2 ;; esac
done
status=0
step() { echo "== $*"; }
want() { [[ $parts == *" $1 "* ]]; }

step "environment"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"

if want tests; then
    step "CUDA tests"
    $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$OUT/tests.log" || status=1
fi

if want speculative; then
    step "speculative decoding by batch size"
    timeout 240 $PY -m tlt.cli bench speculative --device cuda --repeats 3 --prompts 8 \
        --strategies off,tree-d4-k2-v8,tree-d4-k4-v16,tree-d6-k4-v24,ngram-d4 \
        --json "$OUT/speculative.json" 2>&1 | tail -25 | tee "$OUT/speculative.log" || status=1
fi

if want rollout; then
    step "rollout, 16 prompts x 8 samples"
    timeout 180 $PY -m tlt.cli bench rollout --device cuda --repeats 3 --adaptive \
        --strategies tree-d4-k4-v16,tree-d6-k4-v24,chain-d4 --json "$OUT/rollout.json" \
        --plot "$OUT/rollout.png" 2>&1 | tail -20 | tee "$OUT/rollout.log" || status=1
fi

if want rollout_bf16; then
    step "rollout in bf16 (what GPU rollouts run) beside float32 plain decoding"
    timeout 240 $PY -m tlt.cli bench rollout --device cuda --repeats 3 --adaptive --skip-hf --dtype bfloat16 \
        --baseline-dtype float32 --strategies tree-d4-k2-v8 --json "$OUT/rollout_bf16.json" \
        --plot "$OUT/rollout_bf16.png" 2>&1 | tail -20 | tee "$OUT/rollout_bf16.log" || status=1
fi

if want e2e; then
    step "GRPO end to end, off vs tlt, in-process engine on the GPU"
    timeout 150 $PY -m tlt.cli bench e2e --steps 6 --workers 1 --json "$OUT/e2e.json" --out "$OUT/e2e" \
        device=cuda eval.every=6 eval.problems=32 save_every=0 2>&1 | tail -20 | tee "$OUT/e2e.log" || status=1
    rm -rf "$OUT/e2e"
fi
exit $status
