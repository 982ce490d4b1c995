"""Several prepared datasets read as one stream, in proportion to weights (`config.data.mixture`).

`config.data.mixture="data/web=0.7,data/books=0.3"`: each training window comes from one source,
drawn by grain's deterministic mixing (`MapDataset.mix`) from the sources' own seeded shuffles,
so the proportions hold over any stretch of batches, a resumed run reads the batches an
uninterrupted one would, and each process still takes its own rows. The sources must share a
tokenizer (its fingerprint), a token dtype and an end-of-text id. Validation draws windows from
every source in the same proportions. Each source is named as every input is (deltares.common.inputs:
`~` expanded, a path that exists taken literally); one named twice (also through a symlink) is refused.
"""

from __future__ import annotations

import grain
import numpy as np

from deltares.common.domains import POSITIVE
from deltares.common.inputs import resolve_inputs, split_entries
from deltares.data.dataset import TokenData
from deltares.data.documents import DataError


def parse_mixture(spec: str) -> list[tuple[str, float]]:
    """`"a=0.7,b=0.3"` -> [("a", 0.7), ("b", 0.3)], weights normalised to sum to 1."""
    pairs = []
    for part in split_entries(spec, "config.data.mixture"):
        path, sep, weight = part.rpartition("=")
        try:
            value = float(weight)
        except ValueError:
            value = None
        if not sep or not path or value is None or POSITIVE.problem(value):
            raise DataError(f"config.data.mixture: {part!r} is not DIR=WEIGHT with a weight that is finite and "
                            f"{POSITIVE} (e.g. data/web=0.7,data/books=0.3)")
        pairs.append((path, value))
    if len(pairs) < 2:
        raise DataError(f"config.data.mixture={spec!r}: a mixture needs at least two sources")
    total = sum(w for _, w in pairs)
    return [(p, w / total) for p, w in pairs]


class Mixture:
    """The sources of a mixture, checked to be compatible; a `DataSource` (deltares.data.source) like
    each of them, training windows mixed by weight."""

    def __init__(self, spec: str, open_source=TokenData):
        self.spec = self.path = spec
        pairs = parse_mixture(spec)
        folders = resolve_inputs(",".join(path for path, _ in pairs), flag="config.data.mixture", want="folder",
                                 globs=False, duplicates="refuse")
        self.sources = [(open_source(folder), weight) for folder, (_, weight) in zip(folders, pairs)]
        first = self.sources[0][0]
        for data, _ in self.sources[1:]:
            for what, key in (("tokenizer", "tokenizer_fingerprint"), ("token dtype", "dtype"),
                              ("end-of-text id", "eos_id")):
                a, b = getattr(first, key), getattr(data, key)
                if a != b:
                    raise DataError(f"config.data.mixture: {first.path} and {data.path} differ in their {what} "
                                    f"({_short(a)} vs {_short(b)}); mix datasets prepared with one tokenizer")
        self.vocab_size = max(d.vocab_size for d, _ in self.sources)
        self.eos_id = first.eos_id

    def check_ids(self, vocab_size: int) -> None:
        for data, _ in self.sources:
            data.check_ids(vocab_size)

    def train_batches(self, seq_len: int, global_batch: int, seed: int, process_index: int = 0,
                      process_count: int = 1) -> grain.MapDataset:
        """An infinite `MapDataset` of this process's [global_batch / process_count, seq_len + 1]
        batches, each window drawn from one source with the mixture's weights."""
        if global_batch % process_count:
            raise DataError(f"global batch {global_batch} is not divisible by {process_count} processes")
        windows = [data.windows(seq_len) for data, _ in self.sources]
        parts = []
        for i, w in enumerate(windows):
            if len(w) == 0:
                raise DataError(f"{self.sources[i][0].path}: the training split holds no window of "
                                f"{seq_len + 1} tokens")
            parts.append(grain.MapDataset.range(len(w)).seed(seed + i).shuffle().repeat().map(lambda j, i=i: (i, j)))
        ds = grain.MapDataset.mix(parts, [w for _, w in self.sources])[process_index::process_count]

        def read(batch):
            source_B, index_B = (np.asarray(x) for x in batch)
            out = np.zeros((len(index_B), seq_len + 1), np.int32)
            for i, w in enumerate(windows):
                rows = np.flatnonzero(source_B == i)
                if len(rows):
                    out[rows] = w.batch(index_B[rows])
            return out

        return ds.batch(global_batch // process_count, drop_remainder=True).map(read)

    def validation(self, seq_len: int, batch: int, max_batches: int | None) -> tuple[list[np.ndarray], float]:
        """Validation batches from every source in proportion to the weights (at least one each), and
        their mean UTF-8 bytes per token (for bits per byte)."""
        batches, n_bytes, n_tokens = [], 0.0, 0
        for data, weight in self.sources:
            want = max(1, round(weight * max_batches)) if max_batches else None
            mine, bytes_per_token = data.validation(seq_len, batch, want)
            batches += mine
            tokens = sum(b.shape[0] * (b.shape[1] - 1) for b in mine)
            n_tokens += tokens
            n_bytes += tokens * bytes_per_token
        return batches, n_bytes / n_tokens

    def epochs(self, windows: int, seq_len: int) -> float:
        """Epochs of the source the mixture repeats most."""
        return max(data.epochs(windows * weight, seq_len) for data, weight in self.sources)

    def record(self) -> dict:
        records = [data.record() for data, _ in self.sources]
        return {**records[0], "tokens": {data.path: r["tokens"] for (data, _), r in zip(self.sources, records)},
                "mixture": [{"path": data.path, "weight": w} for data, w in self.sources]}

    def unigram(self) -> np.ndarray:
        return sum(data.unigram() for data, _ in self.sources)


def _short(value) -> str:
    return f"{value[:12]}..." if isinstance(value, str) and len(value) > 16 else str(value)
