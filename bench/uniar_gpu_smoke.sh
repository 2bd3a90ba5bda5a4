#!/usr/bin/env bash
# GPU smoke test of UniAR training (not part of CI): one SFT and one GRPO T2I update with
# LoRA on a UniAR directory, printing step time and peak memory.
#   bench/uniar_gpu_smoke.sh /ckpt/uniar [/ckpt/PickScore_v1] [--rows 16 ...]
#   bench/uniar_gpu_smoke.sh --tiny [CLIP_DIR]     # dry run on a random tiny UniAR
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
exec "$PY" bench/uniar_gpu_smoke.py "${model[@]}" "${clip[@]}" "$@"
