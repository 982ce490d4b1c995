"""7.6B: d=4096, 36 layers, 32/8 heads of 128, FFN 12288, Qwen3 vocabulary (7568.4M parameters, tied).

Delta Block defaults to 6 layers per block (6 blocks); remat defaults to "full". Needs a
TPU pod slice (v5p-16, 8 chips, fits delta_block at 39.0 GiB and delta at 55.2 GiB per
chip, baseline 37.0, AOT 2026-12-04 with jax 0.12) or several large GPUs; see docs/guides/scaling-out.md.
The loss is not chunked here: at this scale chunks of 512 tokens raised memory per device (baseline 36.99 -> 37.47, delta_block
49.62 -> 55.11, delta 75.17 -> 82.89 GiB on v5p:2x2x2).

Run: python -m deltares.train --config experiments/s7b6.py:delta_block --workdir runs/s7b6_delta_block \
         --config.data.dataset=DATA   (a prepared FineWeb-Edu with the Qwen3 tokenizer, see docs/guides/data.md)
     Adding --dry_run checks that command on any machine in about 2 s: flags, config, the abstract
     parameters and train step (nothing allocated, the dataset not read).
Paper (validation PPL, 10K steps on FineWeb-Edu, seq 2048): baseline 17.43,
block AttnRes 18.58, Delta Block 16.00 (8.2% better than baseline).
"""

from deltares.training.experiment import PAPER_RECIPE, experiment

MODEL = dict(vocab_size=151936, d_model=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, d_ff=12288,
             loss_chunk=0)  # the plain loss: chunks cost memory at 7.6B (docstring)


# The paper's 7.6B recipe: 131K tokens per step, peak LR 3e-4, warmup 500.
RECIPE = dict(
    data=PAPER_RECIPE["data"],
    train=dict(PAPER_RECIPE["train"], global_batch=64),
    optim=dict(lr=3e-4, lr_min=3e-5, warmup_steps=500),
)


def get_config(arg="delta_block"):
    cfg = experiment("s7b6", MODEL, arg, block_layers=6, recipe=RECIPE)
    cfg.model.remat = "full"  # without it nothing fits at this batch (docs/guides/scaling-out.md, "Will it fit?")
    return cfg
