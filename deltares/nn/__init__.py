"""The model's chain: config -> routing -> residual plan -> router (layers) -> decoder layer -> depth pass -> model;
plus the public depth-routing API (routed, nnx) and the losses.

Shape legend. Array names end in one capital letter per axis (`x_BTD` is [batch, tokens, model
width]); each letter means one thing across deltares/ and kernels_pallas/:

    B  batch (sequences)
    T  tokens: positions of a sequence (in a kernel, the tokens of one tile of N)
    N  tokens of a batch flattened into one axis (B*T; the kernels, per-token statistics)
    D  model width (d_model)
    F  MLP width (d_ff)
    V  vocabulary
    L  layers
    U  units of a scanned stack (one layer each, or one repeat of a layer pattern)
    J  routers (sublayers: two per layer by default, any number in a DepthStack)
    S  sources of depth routing (the embedding and the sublayers' outputs a router mixes)
    H  query heads
    K  key/value heads
    Q  query heads sharing one key/value head (H / K)
    E  head dimension
    C  key/value positions attended to (attention's context: the cache length in generation)
    P  prompt positions (generation, padded)
    M  micro-batches (gradient accumulation)
    G  chunks of a sequence, W tokens each (the chunked loss)
    1  an axis of size 1 (kept for broadcasting)
"""

from deltares.nn.config import BLOCK_MODES, MODES, Mode, model_config
from deltares.nn.layers import DepthRouter
from deltares.nn.model import Transformer
from deltares.nn.routed import DepthRouting
from deltares.nn.routing import depth_route
from deltares.nn.stack import DepthStack
from deltares.nn.weights import layer_params, stack_params

__all__ = ["BLOCK_MODES", "MODES", "Mode", "DepthRouter", "DepthRouting", "DepthStack", "Transformer", "depth_route",
           "layer_params", "model_config", "stack_params"]
