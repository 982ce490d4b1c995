"""Hugging Face Qwen3 checkpoints in and out, for every residual mode.

    model_config, params = from_hf("/path/to/Qwen3-0.6B", residual="delta_block")
    to_hf(model_config, params, "/path/to/out", tokenizer="/path/to/Qwen3-0.6B")

Tensor names (per layer i; `[out, in]` matrices as in PyTorch):

| deltares parameter | Hugging Face tensor |
|---|---|
| embed/embedding [V, D] | model.embed_tokens.weight [V, D] |
| layers_i/attn_norm/scale | model.layers.i.input_layernorm.weight |
| layers_i/attn/{q,k,v}_proj/kernel [D, H, E] (k, v: K heads) | model.layers.i.self_attn.{q,k,v}_proj.weight [H*E, D] |
| layers_i/attn/o_proj/kernel [H, E, D] | model.layers.i.self_attn.o_proj.weight [D, H*E] |
| layers_i/attn/{q,k}_norm/scale [E] | model.layers.i.self_attn.{q,k}_norm.weight |
| layers_i/mlp_norm/scale | model.layers.i.post_attention_layernorm.weight |
| layers_i/mlp/{gate,up}_proj/kernel [D, F] | model.layers.i.mlp.{gate,up}_proj.weight [F, D] |
| layers_i/mlp/down_proj/kernel [F, D] | model.layers.i.mlp.down_proj.weight [D, F] |
| final_norm/scale | model.norm.weight |
| lm_head/kernel [D, V] (untied only) | lm_head.weight [V, D] |
| layers_i/{attn,mlp}_router/query [D] | model.layers.i.{attn,mlp}_res_proj.weight [1, D] |
| layers_i/{attn,mlp}_router/gain [D] | model.layers.i.{attn,mlp}_res_norm.weight [D] |
| layers_i/{attn,mlp}_router/gate [1] | model.layers.i.{attn,mlp}_res_gate [1] |
| layers_i/{attn,mlp}_router/null_source [D] | model.layers.i.{attn,mlp}_null_source [D] |
| final_router/{query,gain} (Kimi modes) | model.final_res_proj.weight [1, D], model.final_res_norm.weight |

The routing names are those of the authors' released PyTorch model (which checkpoints
move between the two code bases, per mode: docs/guides/fine-tuning.md); the gate is
deltares' exact-conversion gate (docs/explanations/modes.md). With scanned layers
(`scan_layers`), `layers/...` holds all layers stacked on a leading axis.
`config.json` is Qwen3's plus `residual_mode`, `residual_block_layers`,
`residual_include_partial`, `residual_gate` and `residual_null_source`. Baseline exports
are plain Qwen3 (`model_type: qwen3`, `Qwen3ForCausalLM`). Routed exports are
`model_type: deltares_qwen3`, `DeltaResQwen3ForCausalLM`, with an `auto_map` to the
PyTorch model in deltares/interop/hf_remote/ (copied into the export directory), so
`AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)` computes the routed
function and `transformers` refuses them without `trust_remote_code`; a directory the
PyTorch model wrote with `save_pretrained` reads back here.

Converting a baseline checkpoint into `delta` or `delta_block` adds a zero gate on
every routed term by default, so the converted model computes exactly the
pretrained function; `residual={"mode": ..., "null_source": True, "gate": False}`
gives the paper's null-source variant instead.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from deltares.nn.config import (
    ADDITIVE_MODES, MIXING_MODES, MODES, ROUTING_MODES, dtype_of, has_router, model_config, validate_model_config,
)
from deltares.nn.depth import init_depth_state
from deltares.nn.routed import DepthRouting
from deltares.nn.model import Transformer
from deltares.interop.safetensors_io import SafetensorsError, SafetensorsFile, write
from deltares.training.steps import abstract_params

ARCHITECTURES = ("Qwen3ForCausalLM", "DeltaResQwen3ForCausalLM")
MODEL_TYPES = {"Qwen3ForCausalLM": "qwen3", "DeltaResQwen3ForCausalLM": "deltares_qwen3"}
REMOTE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_remote")
REMOTE_FILES = ("configuration_deltares_qwen3.py", "modeling_deltares_qwen3.py")
AUTO_MAP = {
    "AutoConfig": "configuration_deltares_qwen3.DeltaResQwen3Config",
    "AutoModelForCausalLM": "modeling_deltares_qwen3.DeltaResQwen3ForCausalLM",
}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
RESIDUAL_KEYS = ("mode", "block_layers", "include_partial", "gate", "null_source")
MIXING_KEYS = ("streams", "dynamic", "dilation", "period")  # conversion into hyper or denseformer
EXACT_MIXING = ("hyper", "denseformer")  # the mixing modes that start as the plain residual
MIXER_PARAMS = ("read", "mix", "write", "w_read", "w_mix", "w_write", "s_alpha", "s_beta", "weights")
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some exports carry; recomputed here

# (parameter path inside a layer, Hugging Face name inside `model.layers.{i}.`, layout)
LAYER_TENSORS = (
    (("attn_norm", "scale"), "input_layernorm.weight", "copy"),
    (("attn", "q_proj", "kernel"), "self_attn.q_proj.weight", "in"),
    (("attn", "k_proj", "kernel"), "self_attn.k_proj.weight", "in"),
    (("attn", "v_proj", "kernel"), "self_attn.v_proj.weight", "in"),
    (("attn", "o_proj", "kernel"), "self_attn.o_proj.weight", "out"),
    (("attn", "q_norm", "scale"), "self_attn.q_norm.weight", "copy"),
    (("attn", "k_norm", "scale"), "self_attn.k_norm.weight", "copy"),
    (("mlp_norm", "scale"), "post_attention_layernorm.weight", "copy"),
    (("mlp", "gate_proj", "kernel"), "mlp.gate_proj.weight", "in"),
    (("mlp", "up_proj", "kernel"), "mlp.up_proj.weight", "in"),
    (("mlp", "down_proj", "kernel"), "mlp.down_proj.weight", "out"),
) + tuple(
    ((f"{sub}_router", leaf), f"{sub}_{name}", layout)
    for sub in ("attn", "mlp")
    for leaf, name, layout in (
        ("query", "res_proj.weight", "row"),
        ("gain", "res_norm.weight", "copy"),
        ("gate", "res_gate", "copy"),
        ("null_source", "null_source", "copy"),
    )
) + tuple(  # hyper, denseformer: created when converting (never stored: deltares.interop.hf exports routing modes)
    ((f"{sub}_router", leaf), f"{sub}_mix.{leaf}", "copy") for sub in ("attn", "mlp") for leaf in MIXER_PARAMS
)
TOP_TENSORS = (
    (("embed", "embedding"), "model.embed_tokens.weight", "copy"),
    (("final_norm", "scale"), "model.norm.weight", "copy"),
    (("lm_head", "kernel"), "lm_head.weight", "in"),
    (("final_router", "query"), "model.final_res_proj.weight", "row"),
    (("final_router", "gain"), "model.final_res_norm.weight", "copy"),
)


class HFError(ValueError):
    """A checkpoint that cannot be read or written; the message names the file or tensor."""


def _hf_shape(layout: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if layout == "copy":
        return shape
    if layout == "row":
        return (1,) + shape
    if layout == "in":  # [D, ...out] -> [prod(out), D]
        return (math.prod(shape[1:]), shape[0])
    return (shape[-1], math.prod(shape[:-1]))  # "out": [...in, D] -> [D, prod(in)]


def _to_hf(layout: str, x: np.ndarray) -> np.ndarray:
    if layout == "copy":
        return x
    if layout == "row":
        return x[None]
    if layout == "in":
        return x.reshape(x.shape[0], -1).T
    return x.reshape(-1, x.shape[-1]).T


def _from_hf(layout: str, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if layout in ("copy", "row"):
        return x.reshape(shape)
    return x.T.reshape(shape)


def _is_routing(path: tuple[str, ...]) -> bool:
    return any(part.endswith("_router") for part in path)


def tensor_table(cfg) -> list[tuple[tuple[str, ...], str, str, tuple[int, ...], int | None]]:
    """Every parameter of the model of `config.model` `cfg` as (path, Hugging Face name, layout,
    per-layer shape, layer index or None), in a fixed order."""
    params = nn.meta.unbox(abstract_params(Transformer(cfg), 1))
    layer_names = {path: (name, layout) for path, name, layout in LAYER_TENSORS}
    top_names = {path: (name, layout) for path, name, layout in TOP_TENSORS}
    table = []
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        path = tuple(str(k.key) for k in key_path)
        if path[0] == "layers":  # scanned: one stacked leaf for all layers
            name, layout = layer_names[path[1:]]
            for i in range(cfg.n_layers):
                table.append((path, f"model.layers.{i}.{name}", layout, tuple(leaf.shape[1:]), i))
        elif path[0].startswith("layers_"):
            i = int(path[0].split("_")[1])
            name, layout = layer_names[path[1:]]
            table.append((path, f"model.layers.{i}.{name}", layout, tuple(leaf.shape), None))
        else:
            name, layout = top_names[path]
            table.append((path, name, layout, tuple(leaf.shape), None))
    return table


# ----------------------------------------------------------------------------- config.json


REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def read_hf_config(path: str) -> dict:
    """config.json of a checkpoint directory, checked to be a Qwen3 we can run."""
    file = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise HFError(f"{path}: no such checkpoint directory")
    if not os.path.exists(file):
        raise HFError(f"{file}: missing (a Hugging Face checkpoint directory needs config.json)")
    try:
        with open(file) as f:
            hf = json.load(f)
    except (OSError, ValueError) as err:
        raise HFError(f"{file}: not readable JSON ({err})") from None
    arch = hf.get("architectures") or []
    # Routed exports before deltares_qwen3 said model_type qwen3 with the routed architecture.
    if hf.get("model_type") not in set(MODEL_TYPES.values()) or not set(arch) & set(ARCHITECTURES):
        raise HFError(
            f"{file}: model_type {hf.get('model_type')!r}, architectures {arch}: only Qwen3 "
            f"({', '.join(f'{t} {a}' for a, t in MODEL_TYPES.items())}) is supported"
        )
    unsupported = {
        "hidden_act": hf.get("hidden_act", "silu") != "silu",
        "attention_bias": bool(hf.get("attention_bias", False)),
        "use_sliding_window": bool(hf.get("use_sliding_window", False)),
        "rope_scaling": bool(hf.get("rope_scaling")) or _rope(hf).get("rope_type", "default") != "default",
    }
    for key, bad in unsupported.items():
        if bad:
            raise HFError(f"{file}: {key}={hf.get(key, _rope(hf))!r} is not supported")
    missing = [key for key in REQUIRED_FIELDS if not isinstance(hf.get(key), int) or isinstance(hf.get(key), bool)]
    if missing:
        raise HFError(f"{file}: {', '.join(missing)} missing or not an integer (a Qwen3 config.json sets "
                      f"{', '.join(REQUIRED_FIELDS)})")
    return hf


def _rope(hf: dict) -> dict:
    return hf.get("rope_parameters") or {}


def stored_residual(hf: dict) -> dict:
    """The residual scheme a config.json records (baseline for a plain Qwen3)."""
    mode = hf.get("residual_mode", "baseline")
    if mode not in MODES:
        raise HFError(f"config.json: residual_mode {mode!r} is unknown; allowed: {', '.join(MODES)}")
    return {
        "mode": mode,
        "block_layers": hf.get("residual_block_layers", min(4, hf["num_hidden_layers"])),
        "include_partial": hf.get("residual_include_partial", True),
        "gate": hf.get("residual_gate", False),
        "null_source": hf.get("residual_null_source", False),
    }


def _target_residual(stored: dict, residual, n_layers: int) -> dict:
    """The scheme to load into: `residual` (None, a mode name or a dict) against what is stored."""
    if residual is None:
        return stored
    want = {"mode": residual} if isinstance(residual, str) else dict(residual)
    mode = want.get("mode", "baseline")
    if mode in MIXING_MODES and mode not in EXACT_MIXING:
        raise HFError(f"mode {mode!r} does not start as a plain residual (its paper's initialisation mixes the streams), "
                      f"so a converted checkpoint would not compute the pretrained function; convert into "
                      f"{', '.join(EXACT_MIXING)} or a routing mode")
    if stored["mode"] != "baseline":
        for key in RESIDUAL_KEYS:
            if key in want and want[key] != stored[key]:
                raise HFError(
                    f"the checkpoint holds {stored['mode']} routing with {key}={stored[key]!r}, not {want[key]!r}; "
                    "convert from a baseline checkpoint instead"
                )
        return stored
    out = {"mode": want.get("mode", "baseline"), "block_layers": want.get("block_layers", min(4, n_layers))}
    out["include_partial"] = want.get("include_partial", True)
    null = want.get("null_source", False)
    # Exact conversion by default: a zero gate on the routed term (unless the paper's null source is asked for).
    out["gate"] = want.get("gate", out["mode"] in ADDITIVE_MODES and not null)
    out["null_source"] = null
    out.update({key: want[key] for key in MIXING_KEYS if key in want})
    return out


def model_config_from_hf(hf: dict, residual=None, **overrides):
    """`config.model` for a Qwen3 config.json; `overrides` set non-architecture fields (dtype, ...)."""
    n_heads = hf["num_attention_heads"]
    theta = _rope(hf).get("rope_theta", hf.get("rope_theta", 10000.0))
    cfg = model_config(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads", n_heads),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
        d_ff=hf["intermediate_size"],
        rope_theta=float(theta),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        residual=_target_residual(stored_residual(hf), residual, hf["num_hidden_layers"]),
        **overrides,
    )
    validate_model_config(cfg)
    return cfg


ARCH_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "rope_theta",
               "norm_eps", "tie_embeddings")


def hf_config(cfg, dtype: str, template: dict | None = None) -> dict:
    """config.json for `config.model` `cfg`: `template` (e.g. the source's) updated with its fields."""
    res = cfg.residual
    arch = ARCHITECTURES[0] if res.mode == "baseline" else ARCHITECTURES[1]
    out = dict(template or {})
    for stale in ("rope_scaling", "auto_map"):
        out.pop(stale, None)
    if res.mode != "baseline":
        out["auto_map"] = dict(AUTO_MAP)
    out.update(
        architectures=[arch],
        model_type=MODEL_TYPES[arch],
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False,
        use_sliding_window=False,
        torch_dtype=dtype,
        dtype=dtype,
        residual_mode=res.mode,
        residual_block_layers=res.block_layers,
        residual_include_partial=res.include_partial,
        residual_gate=res.gate,
        residual_null_source=res.null_source,
    )
    out.setdefault("max_position_embeddings", 40960)
    return out


# ----------------------------------------------------------------------------- reading


def _weight_files(path: str) -> dict[str, SafetensorsFile]:
    """Hugging Face tensor name -> the open file holding it (single file or sharded with an index)."""
    index = os.path.join(path, INDEX)
    try:
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError) as err:
                raise HFError(f"{index}: not a safetensors index ({err})") from None
            files = {}
            for file in sorted(set(weight_map.values())):
                full = os.path.join(path, file)
                if not os.path.exists(full):
                    raise HFError(f"{full}: missing (listed in {INDEX})")
                files[file] = SafetensorsFile(full)
            out = {}
            for name, file in weight_map.items():
                if name not in files[file].names():
                    raise HFError(f"tensor {name}: listed in {INDEX} under {file}, but not in that file")
                out[name] = files[file]
            return out
        single = os.path.join(path, SINGLE)
        if not os.path.exists(single):
            raise HFError(f"{path}: no {SINGLE} or {INDEX}")
        file = SafetensorsFile(single)
        return {name: file for name in file.names()}
    except SafetensorsError as err:
        raise HFError(str(err)) from None


def _tokenizer_vocab(path: str) -> int | None:
    file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(file):
        return None
    import tokenizers  # noqa: PLC0415 - only needed here

    try:
        return tokenizers.Tokenizer.from_file(file).get_vocab_size()
    except Exception as err:  # noqa: BLE001 - the tokenizers library raises plain Exceptions
        raise HFError(f"{file}: not a readable tokenizer ({err})") from None


def _fresh_routing(cfg) -> dict:
    """Initial parameters of the routers (the mixing modes' mixers), from their own initialisers: one
    dict holding every parameter name any of them has (every router starts alike)."""
    res = cfg.residual
    routing = DepthRouting.from_config(cfg)
    e_BTD = jnp.zeros((1, 1, cfg.d_model))
    state = init_depth_state(e_BTD, routing.plan)
    out = {}
    for k in range(2):
        if not has_router(res.mode, k, 2):
            continue
        router = routing.linen_router(k, 2, "router", gate=res.gate, null_source=res.null_source)
        if res.mode in ROUTING_MODES:
            args = (jnp.zeros((1, 1, 1, cfg.d_model)), jnp.ones((1, 1, 1)), jnp.ones((1,), bool), e_BTD)
        elif res.mode == "denseformer":
            args = (state.sources_SBTD, 0, np.ones(routing.plan.n_slots, bool))
        else:
            args = (state.streams_RBTD, 0)
        out.update(nn.meta.unbox(router.init(jax.random.key(0), *args)["params"]))
    return jax.tree.map(np.asarray, out)


def check_checkpoint(path: str, cfg):
    """Checks that `path` holds every tensor of `config.model` `cfg` with the right shape, and
    nothing else, reading only headers. Returns (files by tensor name, table, names to read)."""
    hf = read_hf_config(path)
    stored = stored_residual(hf)
    stored_cfg = model_config_from_hf(hf)
    for field in ARCH_FIELDS:
        if stored_cfg[field] != cfg[field]:
            raise HFError(f"{path}: config.json has {field}={stored_cfg[field]!r}, the model needs {cfg[field]!r}")
    if stored["mode"] != "baseline":
        _target_residual(stored, {k: cfg.residual[k] for k in RESIDUAL_KEYS if k in cfg.residual}, cfg.n_layers)  # same scheme, or an error naming the field
    vocab = _tokenizer_vocab(path)
    if vocab is not None and vocab > cfg.vocab_size:
        raise HFError(f"{path}/tokenizer.json has {vocab} tokens, more than the model's vocab_size={cfg.vocab_size}")
    files = _weight_files(path)
    table = tensor_table(cfg)
    fresh = stored["mode"] == "baseline"  # routing parameters are created, not read
    wanted = {name for p, name, *_ in table if not (fresh and _is_routing(p))}
    for p, name, layout, shape, _ in table:
        if name not in wanted:
            continue
        if name not in files:
            raise HFError(f"tensor {name}: missing from {path}")
        got, need = files[name].shape(name), _hf_shape(layout, shape)
        if got != need:
            raise HFError(f"tensor {name} in {files[name].path}: shape {list(got)}, the model needs {list(need)}")
    ignored = {"lm_head.weight"} if cfg.tie_embeddings else set()
    extra = sorted(n for n in files if n not in wanted and n not in ignored and not n.endswith(IGNORED_SUFFIXES))
    if extra:
        raise HFError(f"tensor {extra[0]} in {files[extra[0]].path}: not a parameter of this model ({len(extra)} unexpected)")
    return files, table, wanted


def load_params(path: str, cfg) -> dict:
    """The parameters of `config.model` `cfg` from the checkpoint in `path`, as float numpy arrays
    of `cfg.param_dtype`. Routing parameters absent from a baseline checkpoint start at their
    initial values. Every name and shape is checked before any tensor is read."""
    files, table, wanted = check_checkpoint(path, cfg)
    dtype = np.dtype(dtype_of(cfg.param_dtype))
    created = any(name not in wanted for _, name, *_ in table)  # routing parameters of a baseline checkpoint
    routing = _fresh_routing(cfg) if created else None
    params: dict = {}
    for p, name, layout, shape, layer in table:
        if name in wanted:
            value = _from_hf(layout, files[name].read(name).astype(dtype), shape)
        else:
            value = routing[p[-1]].astype(dtype)
        node = params
        for key in p[:-1]:
            node = node.setdefault(key, {})
        if layer is None:
            node[p[-1]] = value
        else:
            if p[-1] not in node:
                node[p[-1]] = np.empty((cfg.n_layers,) + shape, dtype)
            node[p[-1]][layer] = value
    return params


def from_hf(path: str, residual=None, **overrides):
    """(config.model, params) of the Hugging Face Qwen3 checkpoint in directory `path`.

    `residual`: None (the stored scheme; baseline for a plain Qwen3), a mode name, or a
    dict of `config.model.residual` fields. `overrides` set other model fields (dtype,
    param_dtype, scan_layers, remat)."""
    cfg = model_config_from_hf(read_hf_config(path), residual, **overrides)
    return cfg, load_params(path, cfg)


# ----------------------------------------------------------------------------- writing


def _flat(params) -> dict[tuple[str, ...], np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(nn.meta.unbox(params))[0]
    return {tuple(str(k.key) for k in path): leaf for path, leaf in leaves}


def _check_export(cfg, table, flat) -> dict:
    """{parameter path: shape} of every parameter `table` exports; HFError where `flat` lacks one, has one
    of another shape, or has one the table does not know."""
    need = {p: shape for p, _, _, shape, layer in table if layer is None}
    need.update({p: (cfg.n_layers,) + shape for p, _, _, shape, layer in table if layer is not None})
    for p, shape in need.items():
        if p not in flat:
            raise HFError(f"parameter {'/'.join(p)}: missing from the parameters to export")
        if tuple(np.shape(flat[p])) != shape:
            raise HFError(f"parameter {'/'.join(p)}: shape {list(np.shape(flat[p]))}, config needs {list(shape)}")
    extra = sorted(set(flat) - set(need))
    if extra:
        raise HFError(f"parameter {'/'.join(extra[0])}: not part of a {cfg.residual.mode} model of this config")
    return need


def _shards(table, sizes, max_shard_bytes: int) -> list[list]:
    """The table's entries in order, cut into shards of at most `max_shard_bytes` (one entry at least)."""
    shards, current, size = [], [], 0
    for entry, nbytes in zip(table, sizes):
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(entry)
        size += nbytes
    shards.append(current)
    return shards


def to_hf(cfg, params, path: str, *, dtype: str = "float32", tokenizer: str | None = None,
          template: dict | None = None, max_shard_bytes: int = 5 * 2**30) -> None:
    """Writes `params` of `config.model` `cfg` as a Hugging Face checkpoint directory `path`:
    config.json, safetensors (sharded with an index above `max_shard_bytes`), and the
    tokenizer from `tokenizer` (a tokenizer.json or a directory holding one) when given."""
    validate_model_config(cfg)
    if cfg.residual.mode in MIXING_MODES:
        raise HFError(f"mode {cfg.residual.mode!r} has no Hugging Face model: exports are of the routing modes "
                      f"({', '.join(ROUTING_MODES)}), whose PyTorch model deltares ships; keep the deltares checkpoint")
    if dtype not in ("float32", "bfloat16"):
        raise HFError(f"dtype {dtype!r}: allowed float32, bfloat16")
    table = tensor_table(cfg)
    flat = _flat(params)
    need = _check_export(cfg, table, flat)
    tokenizer_file = None
    if tokenizer:
        tokenizer_file = os.path.join(tokenizer, "tokenizer.json") if os.path.isdir(tokenizer) else tokenizer
        if not os.path.exists(tokenizer_file):
            raise HFError(f"{tokenizer_file}: missing (the tokenizer to export)")

    np_dtype = np.dtype(dtype_of(dtype))
    sizes = [math.prod(_hf_shape(layout, shape)) * np_dtype.itemsize for _, _, layout, shape, _ in table]
    shards = _shards(table, sizes, max_shard_bytes)
    os.makedirs(path, exist_ok=True)
    host = {p: None for p in need}

    def tensors(entries):
        for p, name, layout, _, layer in entries:
            if host[p] is None:
                host[p] = np.asarray(jax.device_get(flat[p]))
            value = host[p] if layer is None else host[p][layer]
            yield name, _to_hf(layout, value).astype(np_dtype)

    names = [SINGLE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for stale in (INDEX, SINGLE):
        if os.path.exists(os.path.join(path, stale)):
            os.remove(os.path.join(path, stale))
    for file, entries in zip(names, shards):
        write(os.path.join(path, file), tensors(entries), metadata={"format": "pt"})
    if len(shards) > 1:
        weight_map = {name: file for file, entries in zip(names, shards) for _, name, *_ in entries}
        with open(os.path.join(path, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config(cfg, dtype, template), f, indent=2)
    for file in REMOTE_FILES:  # the PyTorch model of routed exports; baseline is transformers' own Qwen3
        if cfg.residual.mode != "baseline":
            shutil.copyfile(os.path.join(REMOTE_DIR, file), os.path.join(path, file))
        elif os.path.exists(os.path.join(path, file)):
            os.remove(os.path.join(path, file))
    if tokenizer_file:
        shutil.copyfile(tokenizer_file, os.path.join(path, "tokenizer.json"))
        extra_file = os.path.join(os.path.dirname(tokenizer_file), "tokenizer_config.json")
        if os.path.exists(extra_file):
            shutil.copyfile(extra_file, os.path.join(path, "tokenizer_config.json"))
