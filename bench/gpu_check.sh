#!/usr/bin/env bash
# One device check (not part of CI), for a single CUDA GPU:
#  (a) the three smoke scripts in their tiny mode: janus_gpu_smoke.py --tiny, uniar_gpu_smoke.py
#      --tiny (both with a tiny random CLIP scorer, so T2I / GRPO run too), and
#      parallel_gpu_smoke.py under none / ddp / fsdp2 x tiny / janus on 1 rank;
#  (b) full shapes: random-weight checkpoints written by `uniweave models write-full-shape`
#      (janus-pro-1b: SigLIP-L/16 384 px, width 2048 x 24 layers, vocab 102,400, VQ 16,384
#      codes; qwen3-vl-2b: Qwen3-VL-2B's text and vision towers + UniAR's BSQ head), one
#      GRPO I2T + one T2I update (Janus) and one SFT + one GRPO T2I update (UniAR), LoRA;
#  (c) the rollout benches on the device: bench/rollout.py (256 requests, 32 and 64 slots,
#      varied lengths and all-to-cap, vs HF generate) and bench/rollout_t2i.py (16 and 64
#      images, CFG w = 5, vs transformers' Janus image generation), each `--repeats 3`,
#      identical tokens checked by the bench; their `result:` lines end up in one table.
# MODEL_DIR arguments replace (b)'s random checkpoints: a directory with `uniweave_model.json`
# is a UniAR one, one whose config.json says `"model_type": "janus"` a Janus-Pro one.
# --dry-run (CPU): every step above at tiny shapes (`write-full-shape --shape small`, the
# same files and keys at widths of 16-64; the tiny Janus at a 4x4 image grid), with 2 rows
# (one GRPO group of 2) per update, one update per parallel mode, and the rollout benches
# at 16 requests / 4 and 8 slots / 8 new tokens and 2 and 4 images of 4x4 codes.
# Every sub-check is independent (one failing does not stop the others) and ends with a
# `CHECK | name | PASS/FAIL | ...` line; updates print `RESULT | ... |` rows; both are
# gathered into tables at the end. The whole log goes to $OUT/log.txt (OUT: a temp dir
# when unset).
#   bench/gpu_check.sh                       # everything
#   bench/gpu_check.sh /ckpt/Janus-Pro-1B /ckpt/uniar   # (b) on these checkpoints instead
#   GPU_CHECK_ONLY="janus-big uniar-big" bench/gpu_check.sh
#   bench/gpu_check.sh --dry-run             # CPU dry run: every step at tiny shapes
#   GPU_CHECK_DRY=1 bench/gpu_check.sh       # the same
# Environment: PY (default .venv/bin/python), GPU_CHECK_REV (commit to print), GPU_CHECK_WHEELS (a folder of wheels to
# install into /tmp/site first), GPU_CHECK_DEADLINE (seconds for everything, default 450;
# a check gets what is left, and is skipped under 20 s).
# On the H200 image (torch 2.11, transformers 5.17, no pydantic) uniweave needs newer
# transformers (5.17 lacks activation_checkpointing_enable and returns Qwen3-VL's
# deepstack_features in another shape): the first run carried pydantic 2.14.4 (+ core,
# annotated-types, typing-inspection, typing-extensions) and transformers 5.25.0 (+
# huggingface-hub 2.4.0, httpx2, httpcore2, truststore, kernels, tomlkit, hf-xet, regex,
# click, peft 0.21.2, accelerate 1.16.0, anyio, h11, idna) as cp312 wheels.
set -uo pipefail
DRY=${GPU_CHECK_DRY:-0}
JANUS_DIR="" UNIAR_DIR=""
for arg in "$@"; do
  case $arg in
  --dry-run) DRY=1 ;;
  -h | --help)
    sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 0
    ;;
  -*)
    echo "gpu_check.sh: unknown option '$arg' (only --dry-run, --help)" >&2
    exit 2
    ;;
  *)
    dir=$(cd "$arg" 2>/dev/null && pwd) || {
      echo "gpu_check.sh: '$arg' is not a directory" >&2
      exit 2
    }
    if [ -f "$dir/uniweave_model.json" ]; then
      kind=UNIAR_DIR
    elif grep -qE '"model_type": *"janus"' "$dir/config.json" 2>/dev/null; then
      kind=JANUS_DIR
    else
      echo "gpu_check.sh: '$arg' is neither a UniAR directory (uniweave_model.json) nor a" \
        "Janus-Pro one (config.json with \"model_type\": \"janus\")" >&2
      exit 2
    fi
    if [ -n "${!kind}" ]; then
      echo "gpu_check.sh: two ${kind%_DIR} checkpoints given ('${!kind}', '$dir')" >&2
      exit 2
    fi
    printf -v "$kind" %s "$dir"
    ;;
  esac
done
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
DEADLINE=${GPU_CHECK_DEADLINE:-450}
ONLY=${GPU_CHECK_ONLY:-}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TOKENIZERS_PARALLELISM=false

checks=()
results=()
benches=()

# GPU_CHECK_ONLY picks checks; env and clip-asset (the T2I scorer the others use) always run
wanted() { [ -z "$ONLY" ] || [[ " env clip-asset $ONLY " == *" $1 "* ]]; }

# check NAME LIMIT_S CMD...: run CMD under min(LIMIT_S, time left), print its CHECK line.
check() {
  local name=$1 limit=$2
  shift 2
  wanted "$name" || return 0
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 20 ]; then
    echo "CHECK | $name | SKIP | - | 0 | deadline: ${left} s left of ${DEADLINE} s"
    checks+=("| $name | SKIP | - | 0 | deadline |")
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS rc status why=""
  echo
  echo "=== $name (limit ${limit} s): $*"
  timeout --kill-after=10 "$limit" "$@" >"$scratch/$name.log" 2>&1
  rc=$?
  tr '\r' '\n' <"$scratch/$name.log" | grep -vE '(Loading weights|Writing model shards|it/s\]|s/it\])' || true
  if [ "$rc" -eq 0 ]; then
    status=PASS
  else
    status=FAIL
    [ "$rc" -eq 124 ] && why="timed out after ${limit} s; "
    # the first error line is the root cause (a rank's own, under torchrun)
    why+=$(grep -aE '^(\[rank[0-9]+\]: )?[A-Za-z_.]*(Error|Exception)\b|CUDA out of memory' \
      "$scratch/$name.log" | head -1 | cut -c1-300)
  fi
  echo "CHECK | $name | $status | rc=$rc | $((SECONDS - t0)) | ${why:--}"
  checks+=("| $name | $status | $rc | $((SECONDS - t0)) | ${why:--} |")
  local row
  while IFS= read -r row; do results+=("${row#RESULT }"); done \
    < <(grep -a '^RESULT |' "$scratch/$name.log" || true)
  while IFS= read -r row; do benches+=("$name: ${row#result: }"); done \
    < <(grep -a '^result: ' "$scratch/$name.log" || true)
}

env_info() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null ||
    echo "no nvidia-smi"
  "$PY" - <<'EOF'
import platform

import peft
import pydantic
import torch
import transformers

print(f"python {platform.python_version()}, torch {torch.__version__}, transformers "
      f"{transformers.__version__}, peft {peft.__version__}, pydantic {pydantic.__version__}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"cuda {torch.version.cuda}: {p.name}, {p.total_memory / 2**30:.1f} GiB, "
          f"{p.multi_processor_count} SMs, bf16 {torch.cuda.is_bf16_supported()}")
else:
    print("no CUDA device: CPU run")
import uniweave  # noqa: F401

print("uniweave imports")
EOF
}

main() {
  echo "gpu_check: $(date -u +%FT%TZ), commit ${GPU_CHECK_REV:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}, dry=$DRY"
  if [ -n "${GPU_CHECK_WHEELS:-}" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site "$GPU_CHECK_WHEELS"/*.whl || echo "WARN: wheel install failed"
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
  local shape=full assets="$scratch/assets"
  # rows per update: full: the smoke defaults / the big-check sizes; dry run: the fewest
  local janus_tiny=() uniar_tiny=() parallel=()
  local janus_rows=(--prompts 2 --group-size 8 --micro-batch 4)
  local uniar_rows=(--rows 16 --group-size 8 --micro-batch 4)
  local device=cuda rollout_args=(--repeats 3) t2i_args=(--repeats 3)
  if [ "$DRY" = 1 ]; then
    # dry run: the tiny Janus at a 4x4 image grid (16 image tokens, not 576), one parallel
    # update instead of three, the fewest rows that still make a GRPO group
    shape=small
    janus_tiny=(--tiny-grid 4 --prompts 1 --group-size 2 --micro-batch 2)
    uniar_tiny=(--rows 2 --group-size 2 --micro-batch 2)
    janus_rows=(--prompts 1 --group-size 2 --micro-batch 2)
    uniar_rows=(--rows 2 --group-size 2 --micro-batch 2)
    parallel=(--updates 1)
    device=cpu
    rollout_args=(--requests 16 --slots 4 8 --max-new-tokens 8 --cap-requests 4)
    t2i_args=(--images 2 4 --grid 4)
  fi
  mkdir -p "$assets"
  export -f env_info
  export PY
  check env 90 bash -c env_info
  check clip-asset 60 "$PY" bench/gpu_assets.py clip "$assets/clip"
  local clip="$assets/clip"

  # (a) the smoke scripts in tiny mode
  check janus-tiny 150 "$PY" bench/janus_gpu_smoke.py --tiny --clip "$clip" --tag janus-tiny \
    ${janus_tiny[*]}
  check uniar-tiny 150 "$PY" bench/uniar_gpu_smoke.py --tiny --clip "$clip" --tag uniar-tiny \
    ${uniar_tiny[*]}

  # (b) larger shapes: the given checkpoint, else write the random one; both updates in one
  # sub-check
  local janus="$assets/janus" uniar="$assets/uniar"
  local write_janus="'$PY' -m uniweave models write-full-shape janus-pro-1b '$janus' --shape $shape"
  local write_uniar="'$PY' -m uniweave models write-full-shape qwen3-vl-2b '$uniar' --shape $shape"
  [ -n "$JANUS_DIR" ] && janus=$JANUS_DIR write_janus="echo 'checkpoint $JANUS_DIR (given)'"
  [ -n "$UNIAR_DIR" ] && uniar=$UNIAR_DIR write_uniar="echo 'checkpoint $UNIAR_DIR (given)'"
  check janus-big 260 bash -c "set -e
    $write_janus
    '$PY' bench/janus_gpu_smoke.py --model '$janus' --clip '$clip' --tag janus-big \
      ${janus_rows[*]}
    rm -rf '$assets/janus'"
  check uniar-big 220 bash -c "set -e
    $write_uniar
    '$PY' bench/uniar_gpu_smoke.py --model '$uniar' --clip '$clip' --tag uniar-big \
      ${uniar_rows[*]}
    rm -rf '$assets/uniar'"

  # (a) parallel smoke on this one GPU (what bench/parallel_gpu_smoke.sh 1 runs), each
  # mode x model its own sub-check
  for model in tiny janus; do
    for mode in none ddp fsdp2; do
      if [ "$mode" = none ]; then
        launch=("$PY")
      else
        launch=("$PY" -m torch.distributed.run --standalone --nproc-per-node=1)
      fi
      check "parallel-$mode-$model" 90 "${launch[@]}" bench/parallel_gpu_smoke.py \
        --mode "$mode" --model "$model" --root "$scratch/parallel" ${parallel[*]}
    done
  done

  # (c) the rollout benches (tokens/s vs the transformers baselines, identical tokens)
  check rollout-text 150 "$PY" bench/rollout.py --device "$device" ${rollout_args[*]}
  check rollout-t2i 120 "$PY" bench/rollout_t2i.py --device "$device" ${t2i_args[*]}

  echo
  echo "## results (one update each; times in s include first-call CUDA warm-up; memory GiB)"
  echo "| check | shapes | setup | step | rollout | reward | train | peak alloc | peak reserved |"
  echo "|---|---|---|---|---|---|---|---|---|"
  [ "${#results[@]}" -gt 0 ] && printf '%s\n' "${results[@]}"
  echo
  echo "## rollout benches (uniweave continuous engine / transformers, useful tokens/s)"
  [ "${#benches[@]}" -gt 0 ] && printf '%s\n' "${benches[@]}"
  echo
  echo "## sub-checks"
  echo "| check | status | rc | wall s | error |"
  echo "|---|---|---|---|---|"
  printf '%s\n' "${checks[@]}"
  echo "gpu_check: done in ${SECONDS} s"
  ! printf '%s\n' "${checks[@]}" | grep -q '| FAIL |'
}

main "$@" 2>&1 | tee "$LOG"
