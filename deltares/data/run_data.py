"""A run's data, read from its config: the tokenizer spec, the prepared dataset (the built-in
corpus prepared on first use) and the streams the trainer reads (shuffled training batches of this
process, fixed validation batches). The trainer, eval, analyze, convert and inference share these.
"""

from __future__ import annotations

import os
from typing import Any, Callable, NamedTuple

import numpy as np

from deltares.data.documents import BUILTIN, DataError
from deltares.data.dataset import TokenData, Windows, eval_batches, train_dataset, train_iterator
from deltares.data.mixture import Mixture, mixture_dataset, mixture_eval_batches, parse_mixture
from deltares.data.paths import builtin_dataset_dir
from deltares.data.prepare import prepare

FROM_HF = "init_from_hf"  # config.data.tokenizer value: the tokenizer of config.init_from_hf


def run_tokenizer(config) -> str:
    """The tokenizer spec of a run's config, `config.data.tokenizer`, with FROM_HF resolved."""
    tokenizer = config["data"]["tokenizer"]
    if tokenizer != FROM_HF:
        return tokenizer
    if not config["init_from_hf"]:
        raise DataError(f"config.data.tokenizer={FROM_HF!r} needs config.init_from_hf")
    return f"hf:{config['init_from_hf']}"


def run_dataset_path(config, workdir: str) -> str:
    """The prepared dataset a run trains on (of a mixture, its first source: they share a tokenizer);
    the built-in corpus is prepared into the run directory, or a local cache for a run on a bucket
    (deltares.data.paths.builtin_dataset_dir)."""
    mixture = config["data"].get("mixture")
    if mixture:
        return parse_mixture(mixture)[0][0]
    path = config["data"]["dataset"]
    return builtin_dataset_dir(workdir, run_tokenizer(config)) if path == BUILTIN else path


def open_run_dataset(config, workdir: str, log: Callable[[str], None] = print) -> TokenData | Mixture:
    """The prepared dataset of a run (see run_dataset_path), the built-in corpus prepared once, or
    the run's mixture of datasets; its vocabulary must fit `config.model.vocab_size`."""
    if config["data"].get("mixture"):
        data = Mixture(config["data"]["mixture"])
        path = data.path
    else:
        path = run_dataset_path(config, workdir)
        if config["data"]["dataset"] == BUILTIN and not os.path.exists(os.path.join(path, "meta.json")):
            tokenizer = run_tokenizer(config)
            log(f"preparing the built-in corpus with tokenizer {tokenizer} into {path}")
            prepare(BUILTIN, tokenizer, path, val_fraction=0.05, progress=False)
        data = TokenData(path)
    if data.vocab_size > config["model"]["vocab_size"]:
        raise DataError(
            f"the tokenizer of {path} has {data.vocab_size} tokens, more than config.model.vocab_size="
            f"{config['model']['vocab_size']}"
        )
    data.check_ids(config["model"]["vocab_size"])
    return data


def check_token_ids(batches, vocab_size: int, where: str) -> None:
    """DataError naming `where` and the id when a batch holds a token id the model has no row for."""
    top = max((int(b.max()) for b in batches if len(b)), default=-1)
    if top >= vocab_size:
        raise DataError(f"{where} holds token id {top}, outside the model's vocabulary of {vocab_size} "
                        "(config.model.vocab_size); prepare the data with the model's tokenizer")


class RunData(NamedTuple):
    data: TokenData | Mixture
    train: Any  # grain iterator of this process's rows of each global batch (get_state / set_state)
    val: list  # the fixed validation batches (np.int32 [batch, seq_len + 1])
    bytes_per_token: float  # the validation batches' mean UTF-8 bytes per token (for bits per byte)
    windows: list[int]  # training windows per epoch (of each source of a mixture)
    weights: list[float]  # the share of each source's windows (1.0 for one dataset)

    def epoch(self, windows_seen: int) -> float:
        """The epoch a run is in after `windows_seen` windows: of the source it repeats most."""
        return max(windows_seen * w / n for n, w in zip(self.windows, self.weights))


def open_run_data(config, workdir: str, process_index: int = 0, process_count: int = 1,
                  log: Callable[[str], None] = print) -> RunData:
    """Everything the trainer reads of a run's data, in one place (see RunData)."""
    data = open_run_dataset(config, workdir, log)
    t, seq_len = config["train"], config["data"]["seq_len"]
    batch = max(1, t["global_batch"] // t["micro_batches"])
    if isinstance(data, Mixture):
        train = mixture_dataset(data, seq_len, t["global_batch"], config["seed"], process_index, process_count)
        val, bytes_per_token = mixture_eval_batches(data, seq_len, batch, t["eval_batches"])
        windows, weights = data.windows_per_epoch(seq_len), data.weights
    else:
        tokens = data.tokens("train")
        train = train_dataset(tokens, seq_len, t["global_batch"], config["seed"], process_index, process_count)
        val, bytes_per_token = eval_batches(data.tokens("val"), seq_len, batch, t["eval_batches"]), \
            data.bytes_per_token("val")
        windows, weights = [len(Windows(tokens, seq_len))], [1.0]
    check_token_ids(val, config["model"]["vocab_size"], f"{data.path} (its validation split)")
    return RunData(data, train_iterator(train, config["data"]["prefetch"]), val, bytes_per_token, windows, weights)


def unigram_perplexity(data: TokenData) -> float:
    """Perplexity on the validation split of add-one-smoothed training token frequencies, from the
    dataset's stored token counts (`TokenData.unigram`): no pass over the token data."""
    train, val = data.unigram().astype(np.float64)
    logp = np.log((train + 1.0) / (train + 1.0).sum())
    return float(np.exp(-(val * logp).sum() / val.sum()))
