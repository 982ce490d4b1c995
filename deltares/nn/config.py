"""Model configuration: defaults and validation of `config.model`.

Every field a user can get wrong is checked here, when the config or the model
is built, so a bad value is a `ValueError` naming the field, never an XLA shape
error deep inside a compile.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_collections

MODES = ("baseline", "full_attnres", "block_attnres", "delta", "delta_block")
BLOCK_MODES = ("block_attnres", "delta_block")
REPLACEMENT_MODES = ("full_attnres", "block_attnres")
ADDITIVE_MODES = ("delta", "delta_block")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
REMAT_POLICIES = ("none", "full", "dots")
ROUTING_IMPLS = ("xla", "pallas", "pallas_tpu", "pallas_gpu")  # see DepthRouter

_POSITIVE_INTS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff")


def model_config(**overrides) -> ml_collections.ConfigDict:
    """A `config.model` with Qwen3 defaults; `overrides` set any field."""
    cfg = ml_collections.ConfigDict(
        dict(
            vocab_size=151936,
            d_model=1024,
            n_layers=28,
            n_heads=16,
            n_kv_heads=8,
            head_dim=128,
            d_ff=3072,
            rope_theta=1e6,
            norm_eps=1e-6,
            tie_embeddings=True,
            dtype="bfloat16",
            param_dtype="float32",
            scan_layers=True,
            remat="none",
            residual=dict(mode="delta_block", block_layers=4, include_partial=True, impl="xla", interpret=False,
                          gate=False, null_source=False),
        )
    )
    residual = overrides.pop("residual", {})
    cfg.update(overrides)
    cfg.residual.update(residual)
    return cfg


def _fail(field: str, value, allowed: str):
    raise ValueError(f"config.model.{field}={value!r} is invalid: {allowed}")


def validate_model_config(cfg) -> None:
    """Raise `ValueError` naming the first invalid field of a `config.model`."""
    for field in _POSITIVE_INTS:
        value = cfg[field]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            _fail(field, value, "must be a positive integer")
    if cfg.n_heads % cfg.n_kv_heads:
        _fail("n_kv_heads", cfg.n_kv_heads, f"must divide n_heads={cfg.n_heads}")
    for field in ("tie_embeddings", "scan_layers", "residual.include_partial", "residual.gate", "residual.null_source",
                  "residual.interpret"):
        value = cfg.residual.get(field[9:], False) if field.startswith("residual.") else cfg[field]
        if not isinstance(value, bool):
            _fail(field, value, "must be true or false")
    for field in ("rope_theta", "norm_eps"):
        if not cfg[field] > 0:
            _fail(field, cfg[field], "must be positive")
    for field in ("dtype", "param_dtype"):
        if cfg[field] not in DTYPES:
            _fail(field, cfg[field], f"allowed: {', '.join(DTYPES)}")
    if cfg.remat not in REMAT_POLICIES:
        _fail("remat", cfg.remat, f"allowed: {', '.join(REMAT_POLICIES)}")
    res = cfg.residual
    if res.mode not in MODES:
        _fail("residual.mode", res.mode, f"allowed: {', '.join(MODES)}")
    if res.get("impl", "xla") not in ROUTING_IMPLS:
        _fail("residual.impl", res.impl, f"allowed: {', '.join(ROUTING_IMPLS)}")
    for field in ("gate", "null_source"):
        if res.get(field, False) and res.mode not in ADDITIVE_MODES:
            _fail(f"residual.{field}", True, f"only for the additive modes {', '.join(ADDITIVE_MODES)}")
    if res.get("impl", "xla") != "xla" and res.get("null_source", False):
        _fail("residual.impl", res.impl, "the Pallas kernel has no null source; use impl='xla' with null_source")
    block = res.block_layers
    if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= cfg.n_layers:
        _fail("residual.block_layers", block, f"must be an integer in [1, n_layers={cfg.n_layers}]")


def dtype_of(name: str):
    """The jnp dtype for a validated dtype name."""
    return DTYPES[name]
