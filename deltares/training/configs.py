"""Building experiment configs: `experiments/<scale>.py:get_config(arg)` calls `experiment`.

`arg` is `mode[,key=value...]`, e.g. `delta_block`, `delta_block,block_layers=4`,
`full_attnres,include_partial=false`, `delta,null_source=true`. Keys: `block_layers`,
`include_partial`, and for converted checkpoints `gate` and `null_source` (DepthRouter).
"""

from __future__ import annotations

import ml_collections
from ml_collections.config_dict import placeholder

from deltares.nn.config import MODES, model_config, validate_model_config

VARIANT_KEYS = {
    "block_layers": int,
    "include_partial": lambda s: _parse_bool("include_partial", s),
    "gate": lambda s: _parse_bool("gate", s),
    "null_source": lambda s: _parse_bool("null_source", s),
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


# The paper's recipe (DESIGN.md section 4): 10K steps of 32 x 2048 tokens (65K per
# step), AdamW (0.9, 0.95, 1e-8), weight decay 0.1, clip 1.0, warmup 1000 then
# cosine to 0.1 x peak, peak 6e-4. `None` leaves a field unset (see `experiment`): the
# dataset must be given on the command line.
PAPER_RECIPE = dict(
    data=dict(dataset=None, tokenizer="hf:/path/to/Qwen3-0.6B", seq_len=2048),
    train=dict(global_batch=32, steps=10_000, eval_every=500, eval_batches=50, checkpoint_every=500),
    optim=dict(lr=6e-4, lr_min=6e-5, warmup_steps=1000),
)


def base_config() -> ml_collections.ConfigDict:
    """Every field of an experiment except `model`, with the paper's optimizer defaults."""
    return ml_collections.ConfigDict(
        dict(
            scale="",
            seed=0,
            init_from="",  # a workdir or checkpoint directory to take parameters from
            init_from_hf="",  # a Hugging Face Qwen3 directory to take parameters from (deltares.interop.hf)
            force=False,  # resume a workdir whose checkpoint has another config
            mesh=dict(data=1, fsdp=-1, tensor=1),  # device mesh; -1 takes the remaining devices
            data=dict(
                dataset="builtin",  # a prepared dataset directory, or "builtin" (Moby-Dick, prepared into the workdir)
                tokenizer="bpe:4096",  # used only to prepare the built-in corpus; "init_from_hf": the checkpoint's
                seq_len=256,
                prefetch=4,
            ),
            train=dict(
                global_batch=8,
                micro_batches=1,  # gradient accumulation: global_batch is split into this many micro-batches
                steps=1000,
                log_every=10,
                eval_every=100,
                eval_batches=20,
                stats_every=100,
                checkpoint_every=100,
                keep_last=3,
                keep_every=0,  # also keep every checkpoint whose step is a multiple of this (0: off)
                peak_tflops=0.0,  # per-device peak for MFU; 0 looks the device up (deltares.training.metrics)
                profile_steps=(),  # (start, end): a jax.profiler trace of steps start..end-1 into <workdir>/profile
                profile_all_processes=False,  # trace every process, not only process 0
                # Weights & Biases (deltares.training.wandb_tracker): off unless project is set; mode "" is
                # WANDB_MODE's, else online ("offline": local files for `wandb sync`)
                wandb=dict(project="", entity="", name="", mode=""),
            ),
            optim=dict(
                lr=6e-4,
                lr_min=6e-5,
                routing_lr=placeholder(float),  # peak LR of routing parameters; unset (None): same as lr
                warmup_steps=1000,
                b1=0.9,
                b2=0.95,
                eps=1e-8,
                weight_decay=0.1,
                weight_decay_mask="matrices",
                clip_norm=1.0,
            ),
        )
    )


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


def experiment(
    scale: str, model: dict, arg: str | None, *, block_layers: int, recipe: dict | None = None
) -> ml_collections.ConfigDict:
    """The experiment config of one scale: `config.model` from `model` and the variant in `arg`,
    training fields from `base_config` updated by `recipe` ({'data': {...}, 'train': {...}, ...})."""
    variant = parse_variant(arg)
    residual = dict(
        mode=variant["mode"],
        block_layers=variant.get("block_layers", block_layers),
        include_partial=variant.get("include_partial", True),
        gate=variant.get("gate", False),
        null_source=variant.get("null_source", False),
    )
    cfg = base_config()
    cfg.scale = scale
    for section, fields in (recipe or {}).items():
        for key, value in fields.items():
            _set(cfg[section], key, value)
    cfg.model = model_config(**dict(model), residual=residual)
    validate_model_config(cfg.model)
    return cfg
