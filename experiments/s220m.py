"""220M: d=768, 12 layers, 12/4 heads of 64, FFN 3072, Qwen3 vocabulary (220.5M parameters, tied).

Delta Block defaults to 2 layers per block (6 blocks), the paper's main-table setting.

Defaults: layers unrolled (`scan_layers=False`), no remat and the plain loss, the fastest setting
that fits the paper's 32 x 2048 on 4 v5p chips (v5p:2x2x1) by the TPU compiler's estimate
(`deltares.aot --estimate`, 2026-12-05, jax 0.12.0.1): baseline 120.1 ms per step, `delta_block`
128.4 (1.069x) and `delta` 135.4 (1.127x), each at about 33 GiB per chip of the chip's 95.74.
Unrolled, each router reads only its own sources and each source's cotangent is summed on its own;
under one layer scan (`--config.model.scan_layers=True`) every router reads the whole source buffer:
122.9, 147.7 and 181.7 ms at 58.73, 67.92 and 88.24 GiB. Unrolled layers compile longer: the step
compiled for v5p in 77 to 192 s and for one GPU in 12 to 134 s on the 2-core CPU machine (scanned: 10
to 25 s for the GPU). On other hardware `deltares.aot --search` names the flags to add.

Run: python -m deltares.train --config experiments/s220m.py:delta_block --workdir runs/s220m_delta_block \
         --config.data.dataset=DATA   (a prepared FineWeb-Edu with the Qwen3 tokenizer, see docs/guides/data.md)
Paper (validation PPL, 10K steps on FineWeb-Edu, seq 2048): baseline 38.71,
block AttnRes 37.39, full AttnRes 37.30, Delta Block 37.08, Delta AttnRes 36.83.
Block-size ablation (block_layers=1, 2, 4, 6, 12): 37.44, 37.08, 36.98, 36.92, 37.34.

Block-size ablation (the paper's Table 2):
    for B in 1 2 4 6 12; do python -m deltares.train --config experiments/s220m.py:delta_block,block_layers=$B \
        --workdir runs/s220m_delta_block_B$B --config.data.dataset=DATA; done
"""

from deltares.training.experiment import PAPER_RECIPE, experiment

MODEL = dict(vocab_size=151936, d_model=768, n_layers=12, n_heads=12, n_kv_heads=4, head_dim=64, d_ff=3072,
             scan_layers=False, loss_chunk=0)  # measured defaults (docstring)

ABLATION_BLOCK_LAYERS = (1, 2, 4, 6, 12)


def get_config(arg="delta_block"):
    return experiment("s220m", MODEL, arg, block_layers=2, recipe=PAPER_RECIPE)
