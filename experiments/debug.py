"""debug: a 3-layer toy model for tests (about 46K parameters, byte vocabulary).

`block_layers=2` on 3 layers, so the last block is shorter: every test of the
block modes sees an uneven split.

Run: python -m deltares.train --config experiments/debug.py --workdir runs/debug  (30 steps, seconds)
Paper: no counterpart; this scale exists for tests only.
"""

from deltares.training.experiment import experiment

MODEL = dict(vocab_size=257, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=64, dtype="float32",
             loss_chunk=0)  # the plain loss: at this size chunking only costs time


RECIPE = dict(
    data=dict(tokenizer="bytes", seq_len=32),
    train=dict(global_batch=4, steps=30, log_every=5, eval_every=10, eval_batches=2, stats_every=10, checkpoint_every=10),
    optim=dict(lr=3e-3, lr_min=3e-4, warmup_steps=5),
)


def get_config(arg="delta_block"):
    return experiment("debug", MODEL, arg, block_layers=2, recipe=RECIPE)
