"""1044M: d=1280, 36 layers, 20/4 heads of 64, FFN 5120, Qwen3 vocabulary (1043.9M parameters, tied).

Delta Block defaults to 6 layers per block (6 blocks).

Defaults: remat `dots` and the plain loss (`loss_chunk=0`), the fastest setting that fits the
paper's 32 x 2048 on 4 v5p chips (v5p:2x2x1) by the TPU compiler's estimate (`deltares.aot
--estimate`, jax 0.12.0.1); nothing fits without remat. Baseline and the block modes unroll their
layers (`scan_layers=False`), where each router reads only its own sources and each source's
cotangent is summed on its own (2026-12-05): baseline 632.1 ms per step, `delta_block` 686.1
(1.085x) at 37.37 GiB per chip, against 820.3 ms under one layer scan (the store-once pass,
which recomputes every layer whatever the policy). `delta` and `full_attnres` keep the scan and
route two-phase in groups of 4 layers (`residual.group_layers=4`): `delta` 897.3 ms (2026-12-04)
against 932.9 unrolled and 1408.9 scanned ungrouped; on one H200 512.3 ms per step against 1397.6
ungrouped. On other hardware `deltares.aot --search` names the flags to add.

Run: python -m deltares.train --config experiments/s1044m.py:delta_block --workdir runs/s1044m_delta_block \
         --config.data.dataset=DATA   (a prepared FineWeb-Edu with the Qwen3 tokenizer, see docs/guides/data.md)
Paper (validation PPL, 10K steps on FineWeb-Edu, seq 2048): baseline 29.70,
block AttnRes 31.76, full AttnRes 33.36, Delta Block 29.19, Delta AttnRes 29.13.
"""

from deltares.training.experiment import PAPER_RECIPE, experiment

MODEL = dict(vocab_size=151936, d_model=1280, n_layers=36, n_heads=20, n_kv_heads=4, head_dim=64, d_ff=5120,
             remat="dots", scan_layers=False, loss_chunk=0)  # measured defaults (docstring)
GROUP_LAYERS = 6  # two-phase groups of the per-sublayer modes, unrolled (docstring)


def get_config(arg="delta_block"):
    return experiment("s1044m", MODEL, arg, block_layers=6, recipe=PAPER_RECIPE, group_layers=GROUP_LAYERS)
