"""A run's data, read from its config: the tokenizer spec, the data source (a prepared dataset,
the built-in corpus prepared on first use, or a mixture; chosen once, in `open_run_dataset`) and the
streams the trainer reads of it (shuffled training batches of this process, fixed validation
batches). The trainer, eval, analyze, convert and inference share these.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, NamedTuple

from deltares.common.inputs import resolve_input
from deltares.data.documents import BUILTIN, DataError
from deltares.data.dataset import TokenData, train_iterator
from deltares.data.mixture import Mixture, parse_mixture
from deltares.data.paths import builtin_dataset_dir
from deltares.data.prepare import prepare
from deltares.data.source import DataSource
from deltares.data.tokenizer import load_tokenizer, tokenizer_sha256

FROM_HF = "init_from_hf"  # config.data.tokenizer value: the tokenizer of config.init_from_hf
BUILTIN_VAL_FRACTION = 0.05  # of the built-in corpus a run prepares


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
    elif config["data"]["dataset"] == BUILTIN:
        source = TokenData(_prepared_dataset(config, workdir, log, through))
    else:  # named as every input is (deltares.common.inputs): one line for a path that leads to no folder
        source = TokenData(_dataset_folder(config["data"]["dataset"]))
    if config["data"].get("tokenizer") == FROM_HF and config.get("init_from_hf"):
        spec = run_tokenizer(config)
        if (want := _fingerprint(spec)) is not None and source.record()["tokenizer_sha256"] != want:
            raise DataError(
                f"{source.path} was tokenized with {source.record()['tokenizer']}, not with the tokenizer of "
                f"config.init_from_hf that config.data.tokenizer={FROM_HF!r} asks for; prepare the data with "
                f"--tokenizer {spec}"
            )
    if source.vocab_size > config["model"]["vocab_size"]:
        raise DataError(
            f"the tokenizer of {source.path} has {source.vocab_size} tokens, more than config.model.vocab_size="
            f"{config['model']['vocab_size']}"
        )
    source.check_ids(config["model"]["vocab_size"])
    return source


def _dataset_folder(path: str) -> str:
    """The real path of the folder `config.data.dataset` names; DataError naming the cause (and how to make
    one, where there is none)."""
    try:
        return resolve_input(path, flag="config.data.dataset", want="folder")
    except DataError as err:
        if str(err).endswith("no such folder"):
            raise DataError(f"{err}; prepare one with python -m deltares.data.prepare --out {path}") from None
        raise


def _prepared_dataset(config, workdir: str, log: Callable[[str], None], through: str | None = None) -> str:
    """The run's built-in corpus (run_dataset_path), prepared there on first use (written through `through`,
    a path to the same run directory). One prepared otherwise than the config asks (another tokenizer,
    another source) is refused (DataError), never trained on."""
    path = run_dataset_path(config, workdir)
    tokenizer = run_tokenizer(config)
    if differences := _builtin_differences(path, tokenizer):
        raise DataError(
            f"{path} holds a dataset prepared with {'; '.join(differences)}: not the data this config trains on; "
            f"use a new --workdir, or the config it was prepared for (or move {path} away to have it prepared again)"
        )
    if not os.path.exists(os.path.join(path, "meta.json")):
        log(f"preparing the built-in corpus with tokenizer {tokenizer} into {path}")
        through = through or workdir
        prepare(BUILTIN, tokenizer, run_dataset_path(config, through), val_fraction=BUILTIN_VAL_FRACTION,
                progress=False, run=through)
    return path


def _builtin_differences(path: str, tokenizer: str) -> list[str]:
    """How the dataset in `path` (whole: its meta.json; or a prepare under way: its plan.json) differs from
    the built-in corpus prepared with the tokenizer spec `tokenizer`, in words; [] when it does not, or
    there is none."""
    recorded = {}
    for name in ("meta.json", "plan.json"):
        try:
            with open(os.path.join(path, name)) as f:
                recorded[name] = json.load(f)
        except FileNotFoundError:
            continue
        except (OSError, ValueError):
            return [f"an unreadable {name}"]
    if not recorded:
        return []
    theirs = recorded.get("meta.json") or recorded["plan.json"]
    out = []
    if theirs.get("source") != BUILTIN:
        out.append(f"source {theirs.get('source')!r} where config.data.dataset asks for {BUILTIN!r}")
    if theirs.get("tokenizer") != tokenizer:
        out.append(f"tokenizer {theirs.get('tokenizer')!r} where config.data.tokenizer asks for {tokenizer!r}")
    for key, want in (("val_fraction", BUILTIN_VAL_FRACTION), ("max_docs", None)):
        if theirs.get(key, want) != want:
            out.append(f"{key} {theirs[key]!r} where the built-in corpus of a run has {want!r}")
    fingerprint = theirs.get("tokenizer_sha256")
    if not out and fingerprint and tokenizer.startswith("hf:") and _fingerprint(tokenizer) not in (None, fingerprint):
        out.append(f"another tokenizer than the one at {tokenizer[3:]} now (its tokenizer.json changed since)")
    return out


def _fingerprint(spec: str) -> str | None:
    """The fingerprint prepare records for the tokenizer `spec` (see tokenizer_sha256); None where it cannot be
    known without training it (bpe:N) or loading it fails (reported where it is loaded)."""
    if spec.startswith("bpe:"):
        return None
    try:
        tokenizer = load_tokenizer(spec)
    except (OSError, ValueError):
        return None
    return tokenizer_sha256(tokenizer.spec, tokenizer.to_json())


def check_trained_tokenizer(dataset: TokenData, trained: dict | None, config, workdir: str, step: int) -> None:
    """DataError when `dataset` was made by another tokenizer than the one checkpoint step `step` of the run
    `workdir` (config `config`) was trained with: its dataset record `trained`, or for checkpoints older
    than that record, the run's own dataset where it is at hand (else nothing is known to check)."""
    if trained is None:
        own = run_dataset_path(config, workdir)
        if not os.path.exists(os.path.join(own, "meta.json")):
            return
        trained = TokenData(own).record()
    if trained.get("tokenizer_sha256") != dataset.tokenizer_fingerprint:
        raise DataError(f"{dataset.path} was tokenized with {dataset.meta['tokenizer']}, another tokenizer than the "
                        f"one step {step} was trained with ({trained.get('tokenizer')}, a different vocabulary or "
                        "merges): its scores would mean nothing")


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
