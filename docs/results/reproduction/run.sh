#!/usr/bin/env bash
# The small-scale reproduction study (README.md here): every number in README.md comes from this.
#   bash docs/results/reproduction/run.sh PART [RUNS_DIR]      PART: seeds blocks routing_lr depth long report families all
# Each part is resumable: a finished run is skipped (its final evaluation is reread), an interrupted
# one continues from its last checkpoint. Budgets: minutes on a quiet 2-core CPU (2026-12-01).
#   seeds       ~105 min  5 modes x 3 seeds, tiny (d256, 6 layers), 400 steps
#   blocks       ~21 min  delta_block with 3 layers per block (block-size ablation), 3 seeds
#   routing_lr   ~32 min  delta and delta_block with a 10x routing LR, 2 seeds (1x: the seeds part)
#   depth   ~90 min/seed  5 modes x 2 seeds at d128 with 24 layers, and with 6 layers (one seed a
#                         session: SEEDS=0, then SEEDS=1; seed 1 took 90 min, seed 0 117 beside long)
#   long         ~60 min  baseline and delta_block to 2,000 steps, seed 0 (91 min beside depth)
#   report        ~3 min  tables (results.md, groups.json, depth.md, long.md), depth figure, routing statistics
#   families     ~65 min  every residual family (FAMILY_MODES: the five routing modes, hyper, mhc, denseformer)
#                         x 2 seeds, tiny, 400 steps (the seeds part's runs where it ran), compared (families.md,
#                         families.json), their weights by depth for seed 0 (figures/families)
# Knobs (for a quick check): STEPS (400), LONG_STEPS (2000), SEEDS (0 1 2), MODES, FAMILY_MODES, CORPORA,
# EVAL_BATCHES (40, per evaluation), DEEP_LAYERS (24, the depth part's deeper model; a multiple of 3).
set -euo pipefail
PART=${1:?"usage: run.sh PART [RUNS_DIR]; PART: seeds blocks routing_lr depth long report families all"}
RUNS=${2:-runs/study}
STEPS=${STEPS:-400}
LONG_STEPS=${LONG_STEPS:-2000}
EVAL_BATCHES=${EVAL_BATCHES:-40}
DEEP_LAYERS=${DEEP_LAYERS:-24}
read -r -a SEEDS <<< "${SEEDS:-0 1 2}"
read -r -a MODES <<< "${MODES:-baseline full_attnres block_attnres delta delta_block}"
read -r -a FAMILY_MODES <<< "${FAMILY_MODES:-baseline full_attnres block_attnres delta delta_block hyper mhc denseformer}"
CORPORA=${CORPORA:-../shared/corpora}
DATA=$RUNS/data
OUT=${OUT:-docs/results/reproduction}

prepare() {
  mkdir -p "$RUNS"
  if [ ! -f "$DATA/meta.json" ]; then
    python -m deltares.data.prepare --source "$CORPORA/*.txt.gz" --tokenizer bpe:4096 --out "$DATA"
  fi
}

# train CONFIG:ARG WORKDIR STEPS [overrides...]
train() {
  local config=$1 workdir=$2 steps=$3
  shift 3
  echo "== $workdir ($config, $steps steps, $(date -u +%H:%M:%S))"
  python -m deltares.train --config "$config" --workdir "$workdir" \
    --config.data.dataset="$DATA" --config.train.steps="$steps" --config.train.eval_every=100 \
    --config.train.checkpoint_every=100 --config.train.eval_batches="$EVAL_BATCHES" "$@" 2>&1 | tail -n 2
}

seeds() {
  for seed in "${SEEDS[@]}"; do
    for mode in "${MODES[@]}"; do
      train "experiments/tiny.py:$mode" "$RUNS/tiny/${mode}_s$seed" "$STEPS" --config.seed="$seed"
    done
  done
}

blocks() {
  for seed in "${SEEDS[@]}"; do
    train experiments/tiny.py:delta_block,block_layers=3 "$RUNS/tiny/delta_block_b3_s$seed" "$STEPS" --config.seed="$seed"
  done
}

# the modes of MODES among $*
among() { for mode in "$@"; do [[ " ${MODES[*]} " == *" $mode "* ]] && echo "$mode"; done; true; }

routing_lr() {
  for seed in "${SEEDS[@]:0:2}"; do
    for mode in $(among delta delta_block); do
      train "experiments/tiny.py:$mode" "$RUNS/tiny/${mode}_lr10x_s$seed" "$STEPS" --config.seed="$seed" \
        --config.optim.routing_lr=0.03
    done
  done
}

depth() {
  for seed in "${SEEDS[@]:0:2}"; do
    for mode in "${MODES[@]}"; do
      train "experiments/tiny_deep.py:$mode" "$RUNS/deep/${mode}_L${DEEP_LAYERS}_s$seed" "$STEPS" --config.seed="$seed" \
        --config.model.n_layers="$DEEP_LAYERS"
      train "experiments/tiny_deep.py:$mode,block_layers=2" "$RUNS/deep/${mode}_L6_s$seed" "$STEPS" \
        --config.seed="$seed" --config.model.n_layers=6
    done
  done
}

long() {
  for mode in $(among baseline delta_block); do
    train "experiments/tiny.py:$mode" "$RUNS/long/${mode}_s0" "$LONG_STEPS" --config.seed=0
  done
}

report() {
  mkdir -p "$OUT/figures"
  python -m deltares.compare "$RUNS"/tiny/* --group --out "$OUT/results.md" --json "$OUT/groups.json" --overwrite
  python -m deltares.compare "$RUNS"/deep/* --group --out "$OUT/depth.md" --json "$OUT/depth.json" \
    --depth_figure "$OUT/figures/depth_ppl.png" --overwrite
  if compgen -G "$RUNS/long/*" > /dev/null; then
    python -m deltares.compare "$RUNS"/long/* --out "$OUT/long.md" --overwrite
  fi
  local tiny=()
  for mode in "${MODES[@]}"; do tiny+=(--workdir "$RUNS/tiny/${mode}_s0"); done
  [[ " ${MODES[*]} " == *" delta_block "* ]] && tiny+=(--workdir "$RUNS/tiny/delta_block_b3_s0")
  python -m deltares.analyze "${tiny[@]}" --out "$OUT/figures"
  local seed deep dir  # the depth part's routing, per seed: figures/deep (seed 0), figures/deep_s1
  for seed in "${SEEDS[@]:0:2}"; do
    deep=()
    for mode in "${MODES[@]}"; do
      deep+=(--workdir "$RUNS/deep/${mode}_L${DEEP_LAYERS}_s$seed" --workdir "$RUNS/deep/${mode}_L6_s$seed")
    done
    dir=$OUT/figures/deep
    [ "$seed" = 0 ] || dir+=_s$seed
    python -m deltares.analyze "${deep[@]}" --out "$dir"
  done
}

families() {
  local runs=() analyzed=() seed mode
  for seed in "${SEEDS[@]:0:2}"; do
    for mode in "${FAMILY_MODES[@]}"; do
      train "experiments/tiny.py:$mode" "$RUNS/tiny/${mode}_s$seed" "$STEPS" --config.seed="$seed"
      runs+=("$RUNS/tiny/${mode}_s$seed")
    done
  done
  for mode in "${FAMILY_MODES[@]}"; do analyzed+=(--workdir "$RUNS/tiny/${mode}_s${SEEDS[0]}"); done
  mkdir -p "$OUT/figures"
  python -m deltares.compare "${runs[@]}" --group --out "$OUT/families.md" --json "$OUT/families.json" --overwrite
  python -m deltares.analyze "${analyzed[@]}" --out "$OUT/figures/families"
}

prepare
case $PART in
  seeds | blocks | routing_lr | depth | long | report | families) "$PART" ;;
  all) seeds; blocks; routing_lr; depth; long; report; families ;;
  *) echo "run.sh: unknown part '$PART'; expected seeds blocks routing_lr depth long report families all" >&2
     exit 2 ;;
esac
