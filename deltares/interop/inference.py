"""Loading a trained model for inference: a deltares run or a Hugging Face Qwen3 directory.

Used by `deltares.generate`, the lm-evaluation-harness adapter and the analysis tools.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import ml_collections

from deltares.interop import hf
from deltares.training.checkpoint import load_checkpoint
from deltares.data.dataset import TokenData
from deltares.data.tokenizer import load_tokenizer
from deltares.data.run_data import run_dataset_path
from deltares.nn.model import Transformer
from deltares.training.steps import abstract_params


class LoadedModel(NamedTuple):
    model: Transformer
    params: Any
    tokenizer: Any  # deltares.data.tokenizer: encode, decode, eos_id, vocab_size
    step: int | None  # training step of a deltares checkpoint; None for Hugging Face
    context: int  # tokens of context to use: the training sequence length (at most 4096 for Hugging Face)


def _is_hf_dir(path: str) -> bool:
    return os.path.exists(os.path.join(path, "config.json")) and not os.path.isdir(os.path.join(path, "checkpoints"))


def check_params(params, model_cfg) -> None:
    """Raises ValueError naming the first parameter that is missing, extra, or shaped unlike the
    parameters of `model_cfg` (a checkpoint that does not match its saved config)."""
    want = nn.meta.unbox(abstract_params(Transformer(model_cfg), 1))
    got = {jax.tree_util.keystr(k): tuple(v.shape) for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    need = {jax.tree_util.keystr(k): tuple(v.shape) for k, v in jax.tree_util.tree_flatten_with_path(want)[0]}
    for name in sorted(set(got) | set(need)):
        if got.get(name) != need.get(name):
            raise ValueError(f"the checkpoint does not match its saved config: parameter {name} is "
                             f"{got.get(name, 'missing')} in the checkpoint, the config needs {need.get(name, 'none')}")


def load_model(path: str) -> LoadedModel:
    """The model, parameters and tokenizer at `path`: a run directory, a checkpoint step
    directory, or a Hugging Face checkpoint directory. Raises FileNotFoundError or ValueError
    with a one-line message."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such checkpoint: {path}")
    if _is_hf_dir(path):
        model_cfg, params = hf.from_hf(path)
        context = min(4096, int(hf.read_hf_config(path).get("max_position_embeddings", 4096)))
        return LoadedModel(Transformer(_for_inference(model_cfg)), params, load_tokenizer(f"hf:{path}"), None, context)
    ckpt = load_checkpoint(path)
    cfg = ml_collections.ConfigDict(ckpt.config)
    params = ckpt.state["params"]
    check_params(params, cfg.model)
    data_dir = run_dataset_path(ckpt.config, ckpt.workdir)
    if os.path.exists(os.path.join(data_dir, "meta.json")):
        tokenizer = TokenData(data_dir).tokenizer()
    elif str(cfg.data.tokenizer).startswith("hf:"):
        tokenizer = load_tokenizer(cfg.data.tokenizer)
    else:
        raise FileNotFoundError(f"the tokenizer of {path}: its dataset {data_dir} is gone")
    return LoadedModel(Transformer(_for_inference(cfg.model)), params, tokenizer, ckpt.step, cfg.data.seq_len)


def _for_inference(model_cfg):
    """No rematerialisation: nothing is differentiated."""
    cfg = model_cfg.copy_and_resolve_references()
    cfg.remat = "none"
    return cfg
