"""1044M: d=1280, 36 layers, 20/4 heads of 64, FFN 5120, Qwen3 vocabulary (1043.9M parameters, tied).

Delta Block defaults to 6 layers per block (6 blocks).

Defaults: remat `dots`, the plain loss (`loss_chunk=0`) and unrolled layers (`scan_layers=False`), the
fastest setting that fits the paper's 32 x 2048 on 4 v5p chips (v5p:2x2x1) by the TPU compiler's
estimate (`deltares.aot --estimate`, 2026-12-05, jax 0.12.0.1); nothing fits without remat. Unrolled,
each router reads only its own sources and each source's cotangent is summed on its own: baseline
632.1 ms per step (34.88 GiB per chip), `delta_block` 686.1 (1.085x; 37.37 GiB). `delta` and `full_attnres`
route two-phase in groups of 6 layers (`residual.group_layers=6`): `delta` 797.3 ms (1.261x) at
66.43 GiB, `full_attnres` 802.2. Under one layer scan (`--config.model.scan_layers=True`, and for
`delta` and `full_attnres` `--config.model.residual.group_layers=4`): baseline 628.5, `delta_block`
820.3, `delta` 897.3 at 26.75 GiB, `full_attnres` 914.5. Unrolled layers compile longer: the step
compiled for v5p in 127 to 250 s and for one GPU in 92 to 180 s on the 2-core CPU machine (scanned:
10 to 50 s for the GPU). On other hardware `deltares.aot --search` names the flags to add.

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
