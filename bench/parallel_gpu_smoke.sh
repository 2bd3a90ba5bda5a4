#!/usr/bin/env bash
# Smoke test of trainer.parallel on N GPUs (not part of CI): a few SFT updates of tiny
# random models (the embedded one and Janus-Pro) under ddp and fsdp2 (and none when N=1),
# printing per-rank step time and peak memory; a checkpoint at the end runs DDP's
# replica-drift check.   bench/parallel_gpu_smoke.sh [N=number of GPUs]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
N=${1:-$("$PY" -c 'import torch; print(max(torch.cuda.device_count(), 1))')}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
modes=(ddp fsdp2)
if [ "$N" = 1 ]; then modes=(none ddp fsdp2); fi
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for model in tiny janus; do
  for mode in "${modes[@]}"; do
    if [ "$mode" = none ]; then
      "$PY" bench/parallel_gpu_smoke.py --mode none --model "$model" --root "$scratch"
    else
      "$PY" -m torch.distributed.run --standalone --nproc-per-node="$N" \
        bench/parallel_gpu_smoke.py --mode "$mode" --model "$model" --root "$scratch"
    fi
  done
done
