#!/usr/bin/env bash
# The GPU measurements of docs/explanations/performance.md in one run, on one local NVIDIA GPU, in the
# current Python environment (launch/gpu.sh makes one), the most wanted first: train steps of s220m and
# s1044m at their defaults (unrolled layers, cuDNN attention, "auto" routing: the Triton kernel) and with
# XLA's routing, 8 x 2048 tokens; the routing kernel against XLA and the copy bandwidth; the s220m step
# without XLA's command buffers; the GPU kernel and cuDNN tests compiled for the device; and the GPU
# step-time model's estimate of the same steps (`deltares.aot --gpu NAME --estimate`). Each stage writes
# OUT/STAGE.txt and prints its tail; with --budget, a stage gets at most the seconds left (then is
# skipped). The stages of 2026-12-04 (layers scanned) run when named in --stages.
#
#   launch/gpu_bench.sh --out runs/gpu_bench --budget 540
#   launch/gpu_bench.sh --stages tests,kernel --dry-run
set -euo pipefail

src=${BASH_SOURCE[0]}
[[ $src == */* ]] || src=./$src
ROOT=$(cd "${src%/*}/.." && pwd)
PYTHON=${DELTARES_PYTHON:-python3}
OUT=runs/gpu_bench BUDGET=0 DRY=0 GPU=
DEFAULT_STAGES=(s220m_defaults s220m_defaults_xla kernel s1044m_defaults s1044m_defaults_xla
  s220m_no_command_buffers tests estimate)
SCANNED_STAGES=(s220m s220m_kernel s220m_cudnn s220m_cudnn_kernel s1044m s1044m_grouped s1044m_segments)
ALL_STAGES=("${DEFAULT_STAGES[@]}" "${SCANNED_STAGES[@]}")
STAGES=$(IFS=,; echo "${DEFAULT_STAGES[*]}")

usage() {
  cat <<EOF
Usage: launch/gpu_bench.sh [options]
  --out DIR          where each stage's output goes, relative to the repository root (default runs/gpu_bench)
  --budget SECONDS   stop starting stages when this many seconds have passed; 0: no limit (default)
  --python PY        the Python whose environment has deltares' requirements and a CUDA jax
                     (env DELTARES_PYTHON; default python3)
  --gpu NAME         h100 or h200: the target of the estimate stage (default: from nvidia-smi, else h100)
  --stages A,B,...   of: ${ALL_STAGES[*]}
                     (default: ${DEFAULT_STAGES[*]}, in this order)
  --dry-run          print every command instead of running it
EOF
}
PROG=gpu_bench.sh
# shellcheck source=launch/common.sh
source "$ROOT/launch/common.sh"

while (($#)); do
  opt=$1
  if [[ $opt == --*=* ]]; then set -- "${opt%%=*}" "${opt#*=}" "${@:2}"; opt=$1; fi
  case $opt in
    --out | --budget | --python | --stages | --gpu)
      (($# >= 2)) || die "$opt needs a value"
      var=${opt#--}
      printf -v "${var^^}" '%s' "$2"
      shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown argument '$opt' (see --help)" ;;
  esac
done
[[ $BUDGET =~ ^[0-9]+$ ]] || die "--budget must be a whole number of seconds, not '$BUDGET'"
IFS=, read -r -a chosen <<<"$STAGES"
((${#chosen[@]})) || die "--stages is empty"
for s in "${chosen[@]}"; do
  [[ " ${ALL_STAGES[*]} " == *" $s "* ]] || die "unknown stage '$s' (choose from: ${ALL_STAGES[*]})"
done

if [[ -z $GPU ]]; then
  GPU=h100
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null |
    grep -qi h200; then GPU=h200; fi
fi
[[ $GPU == h100 || $GPU == h200 ]] || die "--gpu must be h100 or h200, not '$GPU'"

# The train step at the TPU estimates' per-chip load: 8 sequences of 2048 tokens.
STEP=(--batch 8 --seq_len 2048)
DEFAULTS_220=("$PYTHON" -m deltares.bench --config experiments/s220m.py --modes baseline,delta_block,delta "${STEP[@]}"
  --rounds 3 --steps 3)
DEFAULTS_1044=("$PYTHON" -m deltares.bench --config experiments/s1044m.py --modes baseline,delta_block,delta
  "${STEP[@]}" --rounds 2 --steps 2)
# the estimate: one compile per scale and mode, on this machine's CPU (the model needs no GPU)
ESTIMATE="for c in s220m.py:baseline s220m.py:delta_block s220m.py:delta s1044m.py:baseline s1044m.py:delta_block \
s1044m.py:delta; do echo \"== experiments/\$c\"; \"\$0\" -m deltares.aot --config experiments/\$c --gpu $GPU --estimate \
--config.train.global_batch=8 --config.data.seq_len=2048 || exit 1; done"
# the scanned stages: the settings of 2026-12-04 (one layer scan, no remat at s220m)
S220M=("$PYTHON" -m deltares.bench --config experiments/s220m.py --modes baseline,delta_block,delta "${STEP[@]}"
  --rounds 3 --steps 3 --config.model.scan_layers=True)
S1044M=("$PYTHON" -m deltares.bench --config experiments/s1044m.py "${STEP[@]}" --rounds 2 --steps 2
  --config.model.residual.impl=xla)
stage_command() {
  case $1 in
    s220m_defaults) CMD=("${DEFAULTS_220[@]}") ;;
    s220m_defaults_xla) CMD=("${DEFAULTS_220[@]}" --config.model.residual.impl=xla) ;;
    s1044m_defaults) CMD=("${DEFAULTS_1044[@]}") ;;
    s1044m_defaults_xla) CMD=("${DEFAULTS_1044[@]}" --config.model.residual.impl=xla) ;;
    # every kernel launched on its own: what XLA's command buffers (CUDA graphs) save
    s220m_no_command_buffers) CMD=(env XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_enable_command_buffer="
                                   "${DEFAULTS_220[@]}") ;;
    estimate) CMD=(env JAX_PLATFORMS=cpu bash -c "$ESTIMATE" "$PYTHON") ;;
    tests) CMD=(env JAX_PLATFORMS=cuda "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_depth_route_kernel.py
                tests/test_prefix_kernel.py tests/test_attention.py -k "pallas_gpu or cudnn") ;;
    kernel) CMD=("$PYTHON" -m kernels_pallas.depth_route.bench --train_layers 0) ;;
    s220m) CMD=("${S220M[@]}" --config.model.attention=xla --config.model.residual.impl=xla) ;;
    s220m_kernel) CMD=("${S220M[@]}" --config.model.attention=xla --config.model.residual.impl=pallas_gpu) ;;
    s220m_cudnn) CMD=("${S220M[@]}" --config.model.attention=cudnn --config.model.residual.impl=xla) ;;
    s220m_cudnn_kernel) CMD=("${S220M[@]}" --config.model.attention=cudnn --config.model.residual.impl=pallas_gpu) ;;
    s1044m) CMD=("${S1044M[@]}" --modes baseline,delta_block,delta --config.model.scan_layers=True
                 --config.model.residual.group_layers=0) ;;
    # two-phase groups and segments run inside the layer scan, which s1044m's block modes no longer use
    s1044m_grouped) CMD=("${S1044M[@]}" --modes baseline,delta_block,delta --config.model.scan_layers=True
                         --config.model.residual.group_layers=4) ;;
    s1044m_segments) CMD=("${S1044M[@]}" --modes baseline,delta --config.model.scan_layers=True
                          --config.model.residual.group_layers=0 --config.model.residual.scan_segments=12) ;;
  esac
}

run cd "$ROOT"
run mkdir -p "$OUT"
failed=()
for s in "${chosen[@]}"; do
  stage_command "$s"
  if ((DRY)); then
    echo "+ $(quote "${CMD[@]}") > $(quote "$OUT/$s.txt") 2>&1"
    continue
  fi
  limit=0
  if ((BUDGET)); then
    limit=$((BUDGET - SECONDS))
    if ((limit < 30)); then
      echo "== $s: skipped (--budget $BUDGET spent)"
      failed+=("$s (skipped)")
      continue
    fi
  fi
  echo "== $s (at ${SECONDS}s): $(quote "${CMD[@]}")"
  rc=0
  if ((limit)); then
    timeout "$limit" "${CMD[@]}" >"$OUT/$s.txt" 2>&1 || rc=$?
  else
    "${CMD[@]}" >"$OUT/$s.txt" 2>&1 || rc=$?
  fi
  grep -v '^[WI][0-9]' "$OUT/$s.txt" | tail -n 30 || true # the tables, without XLA's log lines
  echo "== $s: exit $rc (at ${SECONDS}s), output in $OUT/$s.txt"
  ((rc == 0)) || failed+=("$s (exit $rc)")
done
if ((${#failed[@]})); then
  echo "$PROG: error: ${#failed[@]} stage(s) did not finish: ${failed[*]}" >&2
  exit 1
fi
