"""Model configuration: the schema of `config.model` (MODEL_FIELDS: each field's type, default,
allowed values and help, declared once), building, validating and describing configs from it.

Every field a user can get wrong is checked here, when the config or the model
is built, so a bad value is a `ValueError` naming the field, never an XLA shape
error deep inside a compile.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp

from deltares.common.domains import AT_LEAST_1, NON_NEGATIVE, POSITIVE, Domain
from deltares.nn.attention import ATTENTION_IMPLS, check_attention
from kernels_pallas.depth_route.api import IMPLEMENTATIONS as ROUTING_IMPLS  # config.model.residual.impl
from kernels_pallas.depth_route.api import wrong_platform

if TYPE_CHECKING:
    import ml_collections

Mode = Literal["baseline", "full_attnres", "block_attnres", "delta", "delta_block", "hyper", "mhc",
               "denseformer"]  # a residual scheme
MODES = get_args(Mode)
ROUTING_MODES = MODES[:5]  # baseline and the four that route over a buffer of depth sources (the paper's)
HYPER_MODES = ("hyper", "mhc")  # n parallel residual streams (deltares.nn.mixing)
MIXING_MODES = HYPER_MODES + ("denseformer",)  # the other depth-mixing families (deltares.nn.mixing)
BLOCK_MODES = ("block_attnres", "delta_block")
REPLACEMENT_MODES = ("full_attnres", "block_attnres")
ADDITIVE_MODES = ("delta", "delta_block")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# hyper, mhc: the streams each sublayer reads and writes (the papers use 2 to 8; every layer boundary holds R
# copies of the stream); mhc: Sinkhorn iterations per sublayer (the paper: 20)
STREAMS = Domain(1, 64)
SINKHORN_ITERATIONS = Domain(1, 10_000)
# config.model.remat -> the jax.checkpoint policy of each layer (None: no rematerialisation)
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    # matrix products without batch dimensions, and two-phase sublayer inputs (deltares.nn.depth.ROUTED_INPUT);
    # scanned routed modes: as "full" (the store-once pass)
    "dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names("routed_input")),
}


class Field(NamedTuple):
    """One config field, declared once: dotted `name`, `default` (None: unset, a typed
    placeholder), `type`, `allowed` (a tuple of values, a `Domain` of numbers, or None: any)
    and `help`."""

    name: str
    default: Any
    type: type
    allowed: Any = None
    help: str = ""


MODEL_FIELDS = (
    Field("vocab_size", 151936, int, AT_LEAST_1, "vocabulary size (embedding and LM head rows)"),
    Field("d_model", 1024, int, AT_LEAST_1, "model width D"),
    Field("n_layers", 28, int, AT_LEAST_1, "decoder layers (an attention and an MLP sublayer each)"),
    Field("n_heads", 16, int, AT_LEAST_1, "query heads"),
    Field("n_kv_heads", 8, int, AT_LEAST_1, "key/value heads (grouped-query attention); divides n_heads"),
    Field("head_dim", 128, int, AT_LEAST_1, "width of one attention head"),
    Field("d_ff", 3072, int, AT_LEAST_1, "MLP (SwiGLU) hidden width"),
    Field("rope_theta", 1e6, float, POSITIVE, "rotary embedding base"),
    Field("norm_eps", 1e-6, float, POSITIVE, "RMSNorm epsilon (also the depth routers' key norm)"),
    Field("tie_embeddings", True, bool, None, "the LM head is the embedding's transpose"),
    Field("dtype", "bfloat16", str, tuple(DTYPES), "activation and matmul dtype"),
    Field("param_dtype", "float32", str, tuple(DTYPES), "parameter dtype"),
    Field("scan_layers", True, bool, None, "layers under nn.scan (one compiled layer) instead of unrolled"),
    Field("scan_unroll", False, bool, None, "unroll every layer scan in the compiled program (same math; the "
          "TPU compiler's step-time estimate counts a loop body once, so `deltares.aot` estimates with it)"),
    Field("remat", "none", str, tuple(REMAT_POLICIES), "per-layer rematerialisation: none, full (save nothing), "
          "dots (save matmuls without batch dimensions and each two-phase sublayer's input; with scanned layers the "
          "routed modes' store-once pass recomputes each sublayer under any policy, so there it is the same as full)"),
    Field("attention", "auto", str, ATTENTION_IMPLS, "causal self-attention: auto (cudnn on NVIDIA GPUs in bfloat16 "
          "or float16 with a head width of at most 128, else xla), xla (every platform), cudnn (cuDNN's "
          "fused attention, NVIDIA GPUs), splash (the TPU splash-attention Pallas kernel; sequence length a multiple "
          "of 128, and of 512 above it); the same math (deltares.nn.attention)"),
    Field("loss_chunk", 512, int, NON_NEGATIVE, "tokens per chunk of the training and evaluation loss: each "
          "chunk's logits are computed (and recomputed for the gradient) on their own, never all [B, T, V]; "
          "0 or at least seq_len: the plain loss"),
    Field("residual.mode", "delta_block", str, MODES, "residual scheme (docs/explanations/modes.md)"),
    Field("residual.block_layers", 4, int, AT_LEAST_1, "layers per block of the block modes; at most n_layers"),
    Field("residual.include_partial", True, bool, None, "route over the current block's partial sum too"),
    Field("residual.group_layers", 0, int, NON_NEGATIVE, "two-phase grouped routing (unrolled layers, or the "
          "store-once scan of scanned layers under remat; same math): the sources completed before each group of "
          "this many layers (at most: a divisor of block_layers in block modes, of n_layers otherwise) are routed in "
          "one pass for all its sublayers (with impl pallas: the fused K-query kernel); 0 (default): one pass per "
          "sublayer (which is faster where routers read few sources, see docs/explanations/performance.md)"),
    Field("residual.scan_segments", 1, int, AT_LEAST_1, "the store-once layer scan (scanned layers, remat) as at most "
          "this many scans of consecutive layers (block modes: whole blocks), each router reading only the source "
          "slots its segment can have written (docs/explanations/performance.md: fewer bytes, more compiled bodies); 1 "
          "(default): one scan, every router reading all slots (masked)"),
    Field("residual.impl", "auto", str, ROUTING_IMPLS, "depth routing: auto (default: the fastest measured on the "
          "platform: the fused Triton kernel per sublayer on NVIDIA GPUs without remat, xla elsewhere, under remat "
          "and for two-phase routing's phase one), xla, or a fused Pallas kernel (pallas: the target platform's; pallas_tpu, "
          "pallas_gpu: Triton, pallas_mosaic_gpu: Mosaic GPU, which takes unrolled layers' sources as separate "
          "operands; no routing weights; a null source only with two-phase routing)"),
    Field("residual.interpret", False, bool, None, "run the Pallas kernels (depth routing, splash attention) in "
          "interpret mode (CPU tests)"),
    Field("residual.gate", False, bool, None, "a zero-initialised scalar gate on each routed term (conversions; "
          "additive modes)"),
    Field("residual.null_source", False, bool, None, "a learned null source in every routing (additive modes)"),
    Field("residual.streams", 4, int, STREAMS, "hyper, mhc: parallel residual streams (the expansion rate n); "
          "the stream the layers carry is n times wider"),
    Field("residual.dynamic", True, bool, None, "hyper: input-dependent read, write and mixing weights added to "
          "the static ones (dynamic hyper-connections); false: static only"),
    Field("residual.sinkhorn_iterations", 20, int, SINKHORN_ITERATIONS, "mhc: Sinkhorn-Knopp iterations projecting the "
          "stream-mixing matrix onto doubly stochastic matrices (float32)"),
    Field("residual.dilation", 1, int, AT_LEAST_1, "denseformer: layer i averages the outputs of layers j with "
          "(i - j) a multiple of this; at most n_layers"),
    Field("residual.period", 1, int, AT_LEAST_1, "denseformer: a depth-weighted average after every period-th "
          "layer only; at most n_layers"),
)


def _lookup(cfg, name: str):
    """The value of dotted `name` in a (Config)dict; KeyError when any part is missing."""
    value = cfg
    for part in name.split("."):
        value = value[part]
    return value


def build_config(fields, overrides: dict | None = None) -> ml_collections.ConfigDict:
    """A ConfigDict with every field of `fields` at its default (unset fields as typed placeholders),
    then `overrides` (nested dicts) applied."""
    import ml_collections  # here, not at the top: the layers of deltares.nn do without it
    from ml_collections.config_dict import placeholder

    tree: dict = {}
    for f in fields:
        *sections, key = f.name.split(".")
        node = tree
        for section in sections:
            node = node.setdefault(section, {})
        node[key] = placeholder(f.type) if f.default is None else f.default
    cfg = ml_collections.ConfigDict(tree)
    _update(cfg, overrides or {})
    return cfg


def _update(cfg, overrides: dict) -> None:
    import ml_collections

    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), ml_collections.ConfigDict):
            _update(cfg[key], value)
        else:
            cfg[key] = value


def with_defaults(fields, saved: dict) -> dict:
    """A copy of the plain dict `saved` (e.g. an old checkpoint's config) with every field of `fields`
    it lacks set to its default: the one place where configs saved before a field existed are filled."""
    out = _copy(saved)
    for f in fields:
        *sections, key = f.name.split(".")
        node = out
        for section in sections:
            node = node.setdefault(section, {})
        node.setdefault(key, f.default)
    return out


def _copy(tree):
    return {k: _copy(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


def _fail(prefix: str, field: str, value, allowed: str):
    raise ValueError(f"{prefix}{field}={value!r} is invalid: {allowed}")


def check_fields(fields, cfg, prefix: str) -> None:
    """Raise `ValueError` naming (as `prefix` + name) the first field of `fields` that `cfg` lacks,
    or whose value has the wrong type or is not allowed."""
    for f in fields:
        try:
            value = _lookup(cfg, f.name)
        except (KeyError, AttributeError):
            raise ValueError(f"{prefix}{f.name} is missing") from None
        if value is None and f.default is None:
            continue
        if f.type is bool:
            ok, want = isinstance(value, bool), "must be true or false"
        elif f.type is int:
            ok, want = isinstance(value, int) and not isinstance(value, bool), "must be an integer"
        elif f.type is float:
            ok, want = isinstance(value, (int, float)) and not isinstance(value, bool), "must be a number"
        elif f.type is tuple:
            ok, want = isinstance(value, (tuple, list)), "must be a sequence"
        else:
            ok, want = isinstance(value, f.type), f"must be a {f.type.__name__}"
        if not ok:
            _fail(prefix, f.name, value, want)
        number = float(value) if f.type is float else value  # an integer given for a float is a float
        problem = f.allowed.problem(number) if isinstance(f.allowed, Domain) else None
        if problem:
            _fail(prefix, f.name, value, problem)
        elif isinstance(f.allowed, tuple) and value not in f.allowed:
            _fail(prefix, f.name, value, f"allowed: {', '.join(map(str, f.allowed))}")


def describe(fields, prefix: str) -> str:
    """A Markdown table of `fields`: name, type, default, allowed, help (for --helpconfig)."""
    lines = ["| field | type | default | allowed | help |", "|---|---|---|---|---|"]
    for f in fields:
        allowed = ", ".join(map(str, f.allowed)) if isinstance(f.allowed, tuple) else str(f.allowed or "")
        default = "unset" if f.default is None else repr(f.default)
        lines.append(f"| {prefix}{f.name} | {f.type.__name__} | {default} | {allowed} | {f.help} |")
    return "\n".join(lines)


def model_config(**overrides) -> ml_collections.ConfigDict:
    """A `config.model` for `Transformer` with Qwen3 defaults (MODEL_FIELDS; the config reference
    lists every field). Unless given, the block size is at most the depth, so that a small model
    (`model_config(n_layers=2)`) is valid as it stands.

    Args:
        **overrides: any field (`d_model=64`), and `residual=dict(...)` the residual scheme's fields
            (`mode`, `block_layers`, `gate`, ...).

    Returns:
        An `ml_collections.ConfigDict`.

    Example:
        ```python
        from deltares.nn import model_config

        cfg = model_config(n_layers=4, d_model=128, residual=dict(mode="delta", group_layers=2))
        print(cfg.n_layers, cfg.residual.mode, cfg.residual.block_layers)  # 4 delta 4
        ```
    """
    cfg = build_config(MODEL_FIELDS, overrides)
    if "block_layers" not in (overrides.get("residual") or {}):
        cfg.residual.block_layers = min(cfg.residual.block_layers, cfg.n_layers)
    return cfg


def validate_model_config(cfg) -> None:
    """Raise `ValueError` naming the first invalid field of a `config.model`."""
    check_fields(MODEL_FIELDS, cfg, "config.model.")
    prefix = "config.model."
    if cfg.n_heads % cfg.n_kv_heads:
        _fail(prefix, "n_kv_heads", cfg.n_kv_heads, f"must divide n_heads={cfg.n_heads}")
    res = cfg.residual
    if res.mode in MIXING_MODES and res.group_layers:
        _fail(prefix, "residual.group_layers", res.group_layers, f"two-phase routing is for the routing modes; "
              f"mode {res.mode!r} does not route over sources: use 0")
    for field in ("gate", "null_source"):
        if res[field] and res.mode not in ADDITIVE_MODES:
            _fail(prefix, f"residual.{field}", True, f"only for the additive modes {', '.join(ADDITIVE_MODES)}")
    two_phase = res.group_layers > 0 and (not cfg.scan_layers or cfg.remat != "none")  # deltares.nn.residual.two_phase
    if res.impl not in ("xla", "auto") and res.null_source and not two_phase:
        _fail(prefix, "residual.impl", res.impl, "no null source in the Pallas kernel (two-phase routing, "
              "residual.group_layers > 0 with unrolled layers or with scanned layers and remat, merges it in XLA); "
              "use 'xla'")
    if res.block_layers > cfg.n_layers:
        _fail(prefix, "residual.block_layers", res.block_layers, f"must be an integer in [1, n_layers={cfg.n_layers}]")
    if res.mode == "denseformer":  # beyond the depth no layer averages (period) or each reads only itself (dilation)
        for field in ("dilation", "period"):
            if res[field] > cfg.n_layers:
                _fail(prefix, f"residual.{field}", res[field], f"must be an integer in [1, n_layers={cfg.n_layers}]")


def check_platform(cfg, platform: str, seq_len: int) -> None:
    """Raise `ValueError` in one line when a kernel `cfg` (a valid `config.model`) asks for by name cannot
    compile for devices of `platform` ("tpu", "gpu"/"cuda", "cpu") over `seq_len` tokens: the attention
    (deltares.nn.attention.check_attention) or the depth routing's Pallas kernel (`residual.impl`)."""
    res = cfg.residual
    check_attention(cfg.attention, platform, seq_len, res.interpret, dtype_of(cfg.dtype), cfg.head_dim)
    if (why := wrong_platform(res.impl, platform, res.interpret)) is not None:
        _fail("config.model.", "residual.impl", res.impl, f"cannot run here ({why}); use 'auto' (the fastest the "
              "devices run), 'pallas' (the kernel of their platform) or 'xla'")


def has_router(mode: str, k: int, n: int) -> bool:
    """Whether sublayer k of a layer of n sublayers has a router in `mode` (its mixer in the mixing
    modes): every sublayer in the routing and hyper modes, the layer's last in denseformer, none in
    baseline."""
    if mode == "denseformer":
        return k == n - 1
    return mode != "baseline"


def dtype_of(name: str):
    """The jnp dtype for a validated dtype name."""
    return DTYPES[name]


__all__ = ["ADDITIVE_MODES", "BLOCK_MODES", "HYPER_MODES", "MIXING_MODES", "MODEL_FIELDS", "MODES", "Mode", "ROUTING_MODES", "REMAT_POLICIES", "REPLACEMENT_MODES", "ROUTING_IMPLS", "dtype_of", "model_config", "validate_model_config"]
