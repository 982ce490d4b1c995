"""A run's data, read from its config: the tokenizer spec, the data source (a prepared dataset,
the built-in corpus prepared on first use, or a mixture; chosen once, in `open_run_dataset`) and the
streams the trainer reads of it (shuffled training batches of this process, fixed validation
batches). The trainer, eval, analyze, convert and inference share these.
"""

from __future__ import annotations

import os
from typing import Any, Callable, NamedTuple

from deltares.data.documents import BUILTIN, DataError
from deltares.data.dataset import TokenData, train_iterator
from deltares.data.mixture import Mixture, parse_mixture
from deltares.data.paths import builtin_dataset_dir
from deltares.data.prepare import prepare
from deltares.data.source import DataSource

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


def open_run_dataset(config, workdir: str, log: Callable[[str], None] = print, through: str | None = None) -> DataSource:
    """The run's data source, chosen here and nowhere else: its mixture of prepared datasets, or its
    prepared dataset (see run_dataset_path; the built-in corpus prepared on first use, written through
    `through`: see deltares.training.workdir.WorkdirLock.through); its vocabulary must fit
    `config.model.vocab_size`."""
    if config["data"].get("mixture"):
        source = Mixture(config["data"]["mixture"])
    else:
        source = TokenData(_prepared_dataset(config, workdir, log, through))
    if source.vocab_size > config["model"]["vocab_size"]:
        raise DataError(
            f"the tokenizer of {source.path} has {source.vocab_size} tokens, more than config.model.vocab_size="
            f"{config['model']['vocab_size']}"
        )
    source.check_ids(config["model"]["vocab_size"])
    return source


def _prepared_dataset(config, workdir: str, log: Callable[[str], None], through: str | None = None) -> str:
    """The run's prepared dataset (run_dataset_path), the built-in corpus prepared there on first use
    (written through `through`, a path to the same run directory)."""
    path = run_dataset_path(config, workdir)
    if config["data"]["dataset"] == BUILTIN and not os.path.exists(os.path.join(path, "meta.json")):
        tokenizer = run_tokenizer(config)
        log(f"preparing the built-in corpus with tokenizer {tokenizer} into {path}")
        prepare(BUILTIN, tokenizer, run_dataset_path(config, through or workdir), val_fraction=0.05, progress=False)
    return path


def check_token_ids(batches, vocab_size: int, where: str) -> None:
    """DataError naming `where` and the id when a batch holds a token id the model has no row for."""
    top = max((int(b.max()) for b in batches if len(b)), default=-1)
    if top >= vocab_size:
        raise DataError(f"{where} holds token id {top}, outside the model's vocabulary of {vocab_size} "
                        "(config.model.vocab_size); prepare the data with the model's tokenizer")


class RunData(NamedTuple):
    source: DataSource  # see open_run_dataset
    train: Any  # grain iterator of this process's rows of each global batch (get_state / set_state)
    val: list  # the fixed validation batches (np.int32 [batch, seq_len + 1])
    bytes_per_token: float  # the validation batches' mean UTF-8 bytes per token (for bits per byte)


def open_run_data(config, workdir: str, process_index: int = 0, process_count: int = 1,
                  log: Callable[[str], None] = print, through: str | None = None) -> RunData:
    """Everything the trainer reads of a run's data, in one place (see RunData)."""
    source = open_run_dataset(config, workdir, log, through)
    t, seq_len = config["train"], config["data"]["seq_len"]
    eval_batch = max(1, t["global_batch"] // t["micro_batches"])
    train = source.train_batches(seq_len, t["global_batch"], config["seed"], process_index, process_count)
    val, bytes_per_token = source.validation(seq_len, eval_batch, t["eval_batches"])
    check_token_ids(val, config["model"]["vocab_size"], f"{source.path} (its validation split)")
    return RunData(source, train_iterator(train, config["data"]["prefetch"]), val, bytes_per_token)
