"""Qwen3-0.6B architecture trained from scratch: d=1024, 28 layers, 16/8 heads of 128, FFN 3072 (596.0M parameters, tied).

Delta Block defaults to 4 layers per block (7 blocks).

Run: python -m deltares.train --config experiments/qwen3_0p6b.py:delta_block --workdir runs/qwen3_0p6b_delta_block \
         --config.data.dataset=DATA   (a prepared FineWeb-Edu with the Qwen3 tokenizer, see docs/guides/data.md)
Paper (validation PPL, 10K steps on FineWeb-Edu, seq 2048): baseline 32.22,
block AttnRes 32.38, Delta Block 31.45.
"""

from deltares.training.configs import PAPER_RECIPE, experiment

MODEL = dict(vocab_size=151936, d_model=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, d_ff=3072)


def get_config(arg="delta_block"):
    return experiment("qwen3_0p6b", MODEL, arg, block_layers=4, recipe=PAPER_RECIPE)
