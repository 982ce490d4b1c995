"""tiny_deep: a deep, narrow model for the reproduction's depth study: d=128, 24 layers (48 sublayers),
4 heads of 32 (2 kv), FFN 384, about 4.8M parameters with the 4096-token BPE, trained like `tiny`.

Delta Block and Block AttnRes default to 3 layers per block: 8 blocks, the paper's block count.
Its 6-layer point (the same width) is `--config.model.n_layers=6` with `block_layers=2` (3 blocks).

Run: python -m deltares.train --config experiments/tiny_deep.py:delta_block --workdir runs/deep
     (400 steps of 8 x 256 tokens; docs/results/reproduction/run.sh depth runs every mode)
Paper: no counterpart; it mimics the paper's deep end (1044M: 36 layers, 7.6B) at tiny width.
"""

import os
import runpy

from deltares.training.experiment import experiment

# tiny's recipe, read from the file beside this one (experiment files load from any directory).
RECIPE = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny.py"))["RECIPE"]

MODEL = dict(vocab_size=4096, d_model=128, n_layers=24, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=384,
             dtype="float32", scan_layers=False, loss_chunk=0)


def get_config(arg="delta_block"):
    return experiment("tiny_deep", MODEL, arg, block_layers=3, recipe=RECIPE)
