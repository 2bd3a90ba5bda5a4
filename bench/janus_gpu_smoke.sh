#!/usr/bin/env bash
# GPU smoke test of Janus-Pro GRPO (not part of CI): one I2T and one T2I update with LoRA
# on a local transformers checkpoint, printing step time and peak memory.
#   bench/janus_gpu_smoke.sh /ckpt/Janus-Pro-1B [/ckpt/PickScore_v1] [--group-size 8 ...]
#   bench/janus_gpu_smoke.sh --tiny [CLIP_DIR]     # dry run on a random tiny checkpoint
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
if [ $# -lt 1 ]; then
  sed -n '2,5p' "$0" >&2
  exit 2
fi
if [ "$1" = "--tiny" ]; then model=(--tiny); else model=(--model "$1"); fi
shift
clip=()
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then clip=(--clip "$1"); shift; fi
exec "$PY" bench/janus_gpu_smoke.py "${model[@]}" "${clip[@]}" "$@"
