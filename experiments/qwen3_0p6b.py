"""Qwen3-0.6B architecture trained from scratch: d=1024, 28 layers, 16/8 heads of 128, FFN 3072 (596.0M parameters, tied).

Delta Block defaults to 4 layers per block (7 blocks).

Defaults: remat `dots`, the plain loss (`loss_chunk=0`) and unrolled layers (`scan_layers=False`), the
fastest setting that fits the paper's 32 x 2048 on 4 v5p chips (v5p:2x2x1) by the TPU compiler's
estimate (`deltares.aot --estimate`, 2026-12-05, jax 0.12.0.1); nothing fits without remat. Unrolled,
each router reads only its own sources: baseline 424.2 ms per step (27.62 GiB per chip; MaxText,
same cost model: 464.2), `delta_block` 472.7 (1.114x; 30.05 GiB), `delta` 542.8 (1.280x), against
431.8, 549.6 and 633.9 under one layer scan (`--config.model.scan_layers=True`). `delta` and
`full_attnres` route two-phase in groups of 4 layers (`residual.group_layers=4`). Unrolled layers
compile for minutes (s1044m's step: 2 to 4 on a 2-core CPU machine). On other hardware
`deltares.aot --search` names the flags to add.

Run: python -m deltares.train --config experiments/qwen3_0p6b.py:delta_block --workdir runs/qwen3_0p6b_delta_block \
         --config.data.dataset=DATA   (a prepared FineWeb-Edu with the Qwen3 tokenizer, see docs/guides/data.md)
Paper (validation PPL, 10K steps on FineWeb-Edu, seq 2048): baseline 32.22,
block AttnRes 32.38, Delta Block 31.45.
"""

from deltares.training.experiment import PAPER_RECIPE, PER_SUBLAYER_GROUP_LAYERS, experiment

MODEL = dict(vocab_size=151936, d_model=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, d_ff=3072,
             remat="dots", scan_layers=False, loss_chunk=0)  # measured defaults (docstring)


def get_config(arg="delta_block"):
    return experiment("qwen3_0p6b", MODEL, arg, block_layers=4, recipe=PAPER_RECIPE,
                      group_layers=PER_SUBLAYER_GROUP_LAYERS)
