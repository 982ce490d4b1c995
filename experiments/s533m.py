"""533M: d=1024, 24 layers, 16/8 heads of 64, FFN 4096, Qwen3 vocabulary (533.1M parameters, tied).

Delta Block defaults to 6 layers per block (4 blocks).

Defaults: remat `dots`, the plain loss (`loss_chunk=0`) and unrolled layers (`scan_layers=False`), the
fastest setting that fits the paper's 32 x 2048 on 4 v5p chips (v5p:2x2x1) by the TPU compiler's
estimate (`deltares.aot --estimate`, 2026-12-05, jax 0.12.0.1); nothing fits without remat. Unrolled,
each router reads only its own sources: baseline 339.5 ms per step (25.82 GiB per chip),
`delta_block` 374.7 (1.104x; 27.78 GiB), `delta` 433.5 (1.277x), against 345.9, 440.5 and 566.3
under one layer scan (`--config.model.scan_layers=True`). `delta` and `full_attnres` route two-phase
in groups of 4 layers (`residual.group_layers=4`). Unrolled layers compile for minutes (s1044m's
step: 2 to 4 on a 2-core CPU machine). On other hardware `deltares.aot --search` names the flags to
add.

Run: python -m deltares.train --config experiments/s533m.py:delta_block --workdir runs/s533m_delta_block \
         --config.data.dataset=DATA   (a prepared FineWeb-Edu with the Qwen3 tokenizer, see docs/guides/data.md)
Paper (validation PPL, 10K steps on FineWeb-Edu, seq 2048): baseline 32.00,
block AttnRes 31.75, full AttnRes 31.68, Delta Block 31.16, Delta AttnRes 31.05.
Block-size ablation (block_layers=2, 6, 12, 24): 31.23, 31.19, 31.22, 31.18.

Block-size ablation (the paper's Table 2):
    for B in 2 6 12 24; do python -m deltares.train --config experiments/s533m.py:delta_block,block_layers=$B \
        --workdir runs/s533m_delta_block_B$B --config.data.dataset=DATA; done
"""

from deltares.training.experiment import PAPER_RECIPE, PER_SUBLAYER_GROUP_LAYERS, experiment

MODEL = dict(vocab_size=151936, d_model=1024, n_layers=24, n_heads=16, n_kv_heads=8, head_dim=64, d_ff=4096,
             remat="dots", scan_layers=False, loss_chunk=0)  # measured defaults (docstring)

ABLATION_BLOCK_LAYERS = (2, 6, 12, 24)


def get_config(arg="delta_block"):
    return experiment("s533m", MODEL, arg, block_layers=6, recipe=PAPER_RECIPE, group_layers=PER_SUBLAYER_GROUP_LAYERS)
