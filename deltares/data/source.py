"""What the trainer reads of its data, whatever the data is: `DataSource`.

A prepared dataset (deltares.data.dataset.TokenData) and a mixture of prepared datasets
(deltares.data.mixture.Mixture) both implement it; deltares.data.run_data.open_run_dataset picks
one from the config, once, and nothing after it asks which one it has.
"""

from __future__ import annotations

from typing import Protocol

import grain
import numpy as np


class DataSource(Protocol):
    """Training windows, validation batches, epochs, the record a checkpoint keeps, and the
    vocabulary facts of a run's data."""

    path: str  # what messages name: the dataset directory, or the mixture's spec
    vocab_size: int  # of the tokenizer that made the data
    eos_id: int  # end-of-text, where a document ends (document masks)

    def check_ids(self, vocab_size: int) -> None:
        """DataError naming the data when it records a token id the model has no row for."""

    def train_batches(self, seq_len: int, global_batch: int, seed: int, process_index: int = 0,
                      process_count: int = 1) -> grain.MapDataset:
        """An infinite `MapDataset` of this process's [global_batch / process_count, seq_len + 1]
        int32 batches of training windows, a pure function of (seed, step)."""

    def validation(self, seq_len: int, batch: int, max_batches: int | None) -> tuple[list[np.ndarray], float]:
        """The fixed validation batches (int32 [batch, seq_len + 1]) and their mean UTF-8 bytes per
        token (for bits per byte)."""

    def epochs(self, windows: int, seq_len: int) -> float:
        """How many epochs `windows` training windows are (of the part of the data read most often)."""

    def record(self) -> dict:
        """What a checkpoint keeps of the data (tokenizer, its fingerprint, token counts), compared
        with the data of a resumed run."""

    def unigram(self) -> np.ndarray:
        """int64 [2, vocab]: token counts of the train and validation splits."""


def unigram_perplexity(source: DataSource) -> float:
    """Perplexity on the validation split of add-one-smoothed training token frequencies, from the
    source's stored token counts (`unigram`): no pass over the token data."""
    train, val = source.unigram().astype(np.float64)
    logp = np.log((train + 1.0) / (train + 1.0).sum())
    return float(np.exp(-(val * logp).sum() / val.sum()))
