"""Building experiment configs: `experiments/<scale>.py:get_config(arg)` calls `experiment`.

`arg` is `mode[,key=value...]`, e.g. `delta_block`, `delta_block,block_layers=4`,
`full_attnres,include_partial=false`, `delta,null_source=true`. Keys: `block_layers`,
`include_partial`, and for converted checkpoints `gate` and `null_source` (DepthRouter).
"""

from __future__ import annotations

import ml_collections
from ml_collections.config_dict import placeholder

from deltares.common.domains import AT_LEAST_1, MESH_AXIS, NON_NEGATIVE, POSITIVE, Domain
from deltares.nn.config import (
    MODEL_FIELDS, MODES, Field, build_config, check_fields, describe, model_config, validate_model_config,
    with_defaults,
)
from deltares.training.optim import DECAY_MASKS

VARIANT_KEYS = {
    "block_layers": int,
    "include_partial": lambda s: _parse_bool("include_partial", s),
    "gate": lambda s: _parse_bool("gate", s),
    "null_source": lambda s: _parse_bool("null_source", s),
    "streams": int,
    "dynamic": lambda s: _parse_bool("dynamic", s),
    "sinkhorn_iterations": int,
    "dilation": int,
    "period": int,
}


def _parse_bool(key: str, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes"):
        return True
    if lowered in ("0", "false", "no"):
        return False
    raise ValueError(f"{key}={text!r}: expected true or false")


def parse_variant(arg: str | None, default_mode: str = "delta_block") -> dict:
    """`'delta_block,block_layers=4'` -> `{'mode': 'delta_block', 'block_layers': 4}`."""
    parts = [p.strip() for p in (arg or "").split(",") if p.strip()]
    out = {"mode": default_mode}
    if parts and "=" not in parts[0]:
        out["mode"] = parts.pop(0)
    if out["mode"] not in MODES:
        raise ValueError(f"unknown residual mode {out['mode']!r} in config argument; allowed: {', '.join(MODES)}")
    for part in parts:
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in VARIANT_KEYS:
            raise ValueError(f"config argument {part!r}: expected key=value with key in {', '.join(VARIANT_KEYS)}")
        try:
            out[key] = VARIANT_KEYS[key](value.strip())
        except ValueError as err:
            raise ValueError(f"config argument {part!r}: {err}") from None
    return out


# The paper's recipe (docs/guides/training.md): 10K steps of 32 x 2048 tokens (65K per
# step), AdamW (0.9, 0.95, 1e-8), weight decay 0.1, clip 1.0, warmup 1000 then
# cosine to 0.1 x peak, peak 6e-4. `None` leaves a field unset (see `experiment`): the
# dataset must be given on the command line.
PAPER_RECIPE = dict(
    data=dict(dataset=None, tokenizer="hf:/path/to/Qwen3-0.6B", seq_len=2048),
    train=dict(global_batch=32, steps=10_000, eval_every=500, eval_batches=50, checkpoint_every=500),
    optim=dict(lr=6e-4, lr_min=6e-5, warmup_steps=1000),
)


BETA = Domain(0, 1, high_open=True)  # an AdamW moment decay: 1 would divide by zero in the bias correction

# Every field of an experiment except `model` (deltares.nn.config.MODEL_FIELDS), declared once.
# A default of None is an unset field (a typed placeholder, still overridable from the command line).
BASE_FIELDS = (
    Field("scale", "", str, None, "the experiment's scale name (experiments/<scale>.py)"),
    Field("seed", 0, int, NON_NEGATIVE, "parameter initialisation and data order"),
    Field("init_from", "", str, None, "a workdir or checkpoint directory to take parameters from"),
    Field("init_from_hf", "", str, None, "a Hugging Face Qwen3 directory to take parameters from "
          "(deltares.interop.hf)"),
    Field("force", False, bool, None, "resume a workdir whose checkpoint has another config"),
    Field("mesh.data", 1, int, MESH_AXIS, "device mesh: data-parallel ways (-1: the remaining devices)"),
    Field("mesh.fsdp", -1, int, MESH_AXIS, "device mesh: FSDP ways (-1: the remaining devices)"),
    Field("mesh.tensor", 1, int, MESH_AXIS, "device mesh: tensor-parallel ways (-1: the remaining devices)"),
    Field("data.dataset", "builtin", str, None, "a prepared dataset directory, or builtin (Moby-Dick, prepared "
          "into the workdir)"),
    Field("data.mixture", "", str, None, "several prepared datasets in proportion, DIR=WEIGHT,DIR=WEIGHT "
          "(deltares.data.mixture); replaces data.dataset"),
    Field("data.tokenizer", "bpe:4096", str, None, "used only to prepare the built-in corpus; init_from_hf: the "
          "checkpoint's"),
    Field("data.seq_len", 256, int, AT_LEAST_1, "tokens per sequence"),
    Field("data.prefetch", 4, int, NON_NEGATIVE, "batches prepared ahead"),
    Field("data.document_mask", False, bool, None, "attention stays inside each document of a window and positions "
          "restart per document (segments from end-of-text); off: documents see their predecessors"),
    Field("train.global_batch", 8, int, AT_LEAST_1, "sequences per step, over all devices"),
    Field("train.micro_batches", 1, int, AT_LEAST_1, "gradient accumulation: global_batch splits into this many"),
    Field("train.steps", 1000, int, AT_LEAST_1, "optimizer steps"),
    Field("train.log_every", 10, int, AT_LEAST_1, "steps between logged metrics"),
    Field("train.eval_every", 100, int, AT_LEAST_1, "steps between evaluations"),
    Field("train.eval_batches", 20, int, NON_NEGATIVE, "batches per evaluation (0: the whole validation split)"),
    Field("train.stats_every", 100, int, NON_NEGATIVE, "steps between routing statistics (0: off)"),
    Field("train.checkpoint_every", 100, int, AT_LEAST_1, "steps between checkpoints"),
    Field("train.keep_last", 3, int, AT_LEAST_1, "checkpoints kept"),
    Field("train.keep_every", 0, int, NON_NEGATIVE, "also keep every checkpoint whose step is a multiple (0: off)"),
    Field("train.resume_step", None, int, NON_NEGATIVE, "resume from this checkpoint step (newer steps are moved "
          "to <workdir>/checkpoints_aside/); unset: the newest usable step"),
    Field("train.peak_tflops", 0.0, float, NON_NEGATIVE, "per-device peak for MFU; 0 looks the device up "
          "(deltares.training.metrics)"),
    Field("train.profile_steps", (), tuple, None, "(start, end): a jax.profiler trace of steps start..end-1 into "
          "<workdir>/profile"),
    Field("train.profile_all_processes", False, bool, None, "trace every process, not only process 0"),
    Field("train.wandb.project", "", str, None, "Weights & Biases project (deltares.training.wandb_tracker); "
          "off unless set"),
    Field("train.wandb.entity", "", str, None, "Weights & Biases entity"),
    Field("train.wandb.name", "", str, None, "Weights & Biases run name"),
    Field("train.wandb.mode", "", str, None, "Weights & Biases mode: empty (WANDB_MODE's, else online), offline, ..."),
    Field("optim.lr", 6e-4, float, NON_NEGATIVE, "peak learning rate"),
    Field("optim.lr_min", 6e-5, float, NON_NEGATIVE, "learning rate at the end of the cosine"),
    Field("optim.routing_lr", None, float, NON_NEGATIVE, "peak LR of routing parameters; unset: same as lr"),
    Field("optim.warmup_steps", 1000, int, NON_NEGATIVE, "linear warmup steps"),
    Field("optim.b1", 0.9, float, BETA, "AdamW beta1"),
    Field("optim.b2", 0.95, float, BETA, "AdamW beta2"),
    Field("optim.eps", 1e-8, float, POSITIVE, "AdamW epsilon"),
    Field("optim.weight_decay", 0.1, float, NON_NEGATIVE, "AdamW weight decay"),
    Field("optim.weight_decay_mask", "matrices", str, DECAY_MASKS, "which parameters decay"),
    Field("optim.clip_norm", 1.0, float, POSITIVE, "global gradient-norm clip"),
)


def base_config() -> ml_collections.ConfigDict:
    """Every field of an experiment except `model` (BASE_FIELDS), with the paper's optimizer defaults."""
    return build_config(BASE_FIELDS)


def validate_config(cfg) -> None:
    """Raise `ValueError` naming the first invalid field of an experiment config (model included):
    its type, its allowed values or range, and the mixture's weights. An unset `data.dataset` (the
    paper-scale experiments leave it to the command line) passes: only training reads it, and the
    trainer asks for it."""
    if cfg.get("data") is not None and cfg.data.get("dataset", "") is None:
        cfg = cfg.copy_and_resolve_references()
        cfg.data.dataset = ""
    check_fields(BASE_FIELDS, cfg, "config.")
    if cfg.data.mixture:
        from deltares.data.mixture import parse_mixture  # noqa: PLC0415 - only for a mixture

        parse_mixture(cfg.data.mixture)
    validate_model_config(cfg.model)


def with_schema_defaults(saved: dict) -> dict:
    """A saved experiment config (a checkpoint's, a plain dict) with the fields added since it was
    written set to their defaults; load paths call this, readers then read fields directly."""
    out = with_defaults(BASE_FIELDS, saved)
    if "model" in out:
        out["model"] = with_defaults(MODEL_FIELDS, out["model"])
    return out


def flat_fields(config: dict, prefix: str = "") -> dict:
    """A config as a plain dict flattened to dotted fields ({"model.n_layers": 6, ...})."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat_fields(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def field_names() -> list[str]:
    """Every field of an experiment config, dotted from `config.` (`config.train.steps`, ...)."""
    return [f"config.{f.name}" for f in BASE_FIELDS] + [f"config.model.{f.name}" for f in MODEL_FIELDS]


def describe_config() -> str:
    """The schema as a Markdown table (`python -m deltares.train --helpconfig`)."""
    return describe(BASE_FIELDS, "config.") + "\n" + "\n".join(describe(MODEL_FIELDS, "config.model.").splitlines()[2:])


def _set(section: ml_collections.ConfigDict, key: str, value) -> None:
    """`section[key] = value`, where `None` unsets the field but keeps its type, so that
    `--config.<section>.<key>=...` still parses (config_flags cannot override a plain None)."""
    if value is None:
        old = section[key]
        if old is None:  # already an unset placeholder
            return
        section[key] = placeholder(type(old))
    else:
        section.update({key: value})


# Two-phase groups for the per-sublayer modes (one slot per sublayer) at the scales that train with
# remat: measured on an H200 (docs/explanations/performance.md), `delta` in groups of 4 layers takes
# 248 ms per step against 603 at s533m and 512 against 1398 at s1044m, `full_attnres` 527 against
# 919 at s1044m; the TPU estimate agrees at s1044m (932 against 1409 ms). The block modes stay
# ungrouped: grouping their few slots was 5% slower on the H200 at s533m and s1044m (TPU estimate: 6%).
PER_SUBLAYER_GROUP_LAYERS = 4


def experiment(
    scale: str, model: dict, arg: str | None, *, block_layers: int, recipe: dict | None = None,
    group_layers: int = 0,
) -> ml_collections.ConfigDict:
    """The experiment config of one scale: `config.model` from `model` and the variant in `arg`,
    training fields from `base_config` updated by `recipe` ({'data': {...}, 'train': {...}, ...}).
    `group_layers`: the default `residual.group_layers` of the per-sublayer modes (`delta`,
    `full_attnres`); the block modes, baseline and the mixing modes keep 0. `denseformer` unrolls its
    layers: under a layer scan its buffer of layer outputs would be stored once per layer for the
    backward pass (memory quadratic in depth), unrolled each output once."""
    variant = parse_variant(arg)
    residual = {"block_layers": block_layers}  # fields the variant leaves out: the schema's defaults
    if variant["mode"] in ("delta", "full_attnres"):
        residual["group_layers"] = group_layers
    if variant["mode"] == "denseformer":
        model = {**model, "scan_layers": False}
    residual.update(variant)
    cfg = base_config()
    cfg.scale = scale
    for section, fields in (recipe or {}).items():
        for key, value in fields.items():
            _set(cfg[section], key, value)
    cfg.model = model_config(**model, residual=residual)
    validate_model_config(cfg.model)
    return cfg
