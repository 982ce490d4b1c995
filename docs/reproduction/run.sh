#!/usr/bin/env bash
# Small-scale reproduction: all five residual modes (delta_block at two block sizes) on the
# public-domain corpora, same tokenizer, data order, seed and steps. See README.md here.
#   bash docs/reproduction/run.sh [RUNS_DIR] [STEPS]
set -euo pipefail
RUNS=${1:-runs/repro}
STEPS=${2:-400}
CORPORA=${CORPORA:-../shared/corpora}
DATA=$RUNS/data
mkdir -p "$RUNS"
if [ ! -f "$DATA/meta.json" ]; then
  python -m deltares.data.prepare --source "$CORPORA/*.txt.gz" --tokenizer bpe:4096 --out "$DATA"
fi
for variant in baseline full_attnres block_attnres delta delta_block delta_block,block_layers=3; do
  name=${variant/,block_layers=/_b}
  python -m deltares.train --config "experiments/tiny.py:$variant" --workdir "$RUNS/$name" \
    --config.data.dataset="$DATA" --config.train.steps="$STEPS" --config.train.eval_every=100 \
    --config.train.checkpoint_every=100 --config.train.eval_batches=40 2>&1 | tail -n 3
done
python -m deltares.compare "$RUNS"/baseline "$RUNS"/full_attnres "$RUNS"/block_attnres "$RUNS"/delta \
  "$RUNS"/delta_block "$RUNS"/delta_block_b3 --out docs/reproduction/results.md
python -m deltares.analyze --workdir "$RUNS"/full_attnres --workdir "$RUNS"/block_attnres --workdir "$RUNS"/delta \
  --workdir "$RUNS"/delta_block --workdir "$RUNS"/delta_block_b3 --workdir "$RUNS"/baseline --out docs/reproduction/figures
