"""Tokenize a corpus once into packed token arrays with a held-out validation split.

    python -m deltares.data.prepare --source builtin --tokenizer bpe:4096 --out data/moby
    python -m deltares.data.prepare --source 'corpora/*.txt.gz' --tokenizer gpt2 --out data/pd
    python -m deltares.data.prepare --source hf:HuggingFaceFW/fineweb-edu --hf_config sample-10BT \
        --tokenizer hf:/models/Qwen3-0.6B --max_docs 2000000 --out data/fwe

Format of the output directory (`DATASET_FORMAT`):
- `train.bin`, `val.bin`: every document's tokens followed by end-of-text, concatenated,
  as a flat little-endian uint16 (vocabulary <= 65536) or uint32 array, memory-mapped
  when read;
- `meta.json`: format version, tokenizer spec, vocabulary size, end-of-text id, token
  dtype, per split the number of tokens, documents and UTF-8 bytes (for bits per byte), the
  largest token id (`max_token_id`, checked against the model's vocabulary) and the tokenizer's
  fingerprint (`tokenizer_sha256`, checked against a checkpoint's dataset on resume and in eval);
- `tokenizer.json`: the Hugging Face tokenizer, when the tokenizer is not `bytes`.

Documents: in text files, blocks separated by blank lines; the validation split is
the last `--val_fraction` of each file's documents (a contiguous tail, so no held-out
paragraph sits between training ones). In a Hugging Face dataset, each record is a
document and every k-th one (k = 1 / val_fraction) is held out.
The directory is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import glob
import gzip
import itertools
import json
import os
import re
import shutil
import sys
from collections.abc import Iterator
from importlib import resources

import numpy as np
from absl import app, flags
from tqdm import tqdm

from deltares.data.tokenizer import bpe_vocab_size, dumps_meta, load_tokenizer, tokenizer_sha256, train_bpe

DATASET_FORMAT = 1
BUILTIN = "builtin"
SPLITS = ("train", "val")
BPE_SAMPLE_DOCS = 20000
_BLANK_LINES = re.compile(r"\n\s*\n")


class DataError(ValueError):
    """Input data that cannot be prepared or read; the message names the problem."""


def read_text(path: str) -> str:
    """The text of a local file, gunzipped when its name ends in `.gz`, decoded as strict UTF-8
    (a leading byte-order mark dropped): what prepare tokenizes and eval scores. Raises DataError
    naming the file for bytes that are not UTF-8 (Latin-1, binary) or a broken gzip stream."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8-sig") as f:
            return f.read()
    except UnicodeDecodeError as err:
        raise DataError(f"{path} is not UTF-8 text (byte {err.start}: {err.reason}); convert it, "
                        "e.g. iconv -f latin1 -t utf-8") from None
    except (gzip.BadGzipFile, EOFError) as err:
        raise DataError(f"{path} is not a readable gzip file: {err}") from None


def split_documents(text: str) -> list[str]:
    return [d.strip() for d in _BLANK_LINES.split(text) if d.strip()]


def text_paths(source: str) -> list[str]:
    """The files of a local text source: paths and globs, comma-separated."""
    paths: list[str] = []
    for pattern in source.split(","):
        pattern = os.path.expanduser(pattern.strip())
        found = sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
        for path in found:
            if os.path.isdir(path):
                raise DataError(f"{path} is a directory; pass files or a glob such as '{path}/*.txt'")
            if not os.path.isfile(path):
                raise DataError(f"no such file: {path}")
            paths.append(path)
    if not paths:
        raise DataError(f"no files match {source!r}")
    return paths


def read_documents(source: str) -> list[str]:
    """Every document of a local text source (see `text_paths`), file by file, as prepare splits them."""
    return [doc for path in text_paths(source) for doc in split_documents(read_text(path))]


def document_bytes(doc: str) -> int:
    """The bytes a document counts for bits per byte: its UTF-8 bytes plus one for the separator
    that its end-of-text token stands for (so the end-of-text is scored against a byte)."""
    return len(doc.encode("utf-8")) + 1


def encode_documents(docs: list[str], tokenizer) -> list[list[int]]:
    """Each document's tokens followed by end-of-text."""
    encoded = tokenizer.encode_batch(docs) if hasattr(tokenizer, "encode_batch") else map(tokenizer.encode, docs)
    return [list(ids) + [tokenizer.eos_id] for ids in encoded]


def file_documents(paths: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """(train, val) documents of text files: each file's last `val_fraction` is held out."""
    train, val = [], []
    for path in paths:
        docs = split_documents(read_text(path))
        n_val = int(round(len(docs) * val_fraction)) if len(docs) > 1 else 0
        if val_fraction > 0 and len(docs) > 1:
            n_val = max(1, n_val)
        train.extend(docs[: len(docs) - n_val])
        val.extend(docs[len(docs) - n_val :])
    return train, val


def builtin_path() -> str:
    return str(resources.files("deltares.data") / "assets" / "mobydick.txt.gz")


def hf_documents(name: str, config: str | None, split: str, field: str, max_docs: int | None) -> Iterator[str]:
    """Records of a Hugging Face dataset, streamed (a hub name, or a local dataset directory)."""
    import datasets  # optional dependency: only this source needs it

    if os.path.isdir(name) and os.path.exists(os.path.join(name, "state.json")):
        ds = datasets.load_from_disk(name)
        ds = ds[split] if isinstance(ds, datasets.DatasetDict) else ds
    else:
        ds = datasets.load_dataset(name, config, split=split, streaming=True)
    for record in itertools.islice(ds, max_docs):
        if field not in record:
            raise DataError(f"dataset {name!r} has no text field {field!r}; fields: {sorted(record)}")
        text = record[field]
        if text and text.strip():
            yield text


class _TokenWriter:
    """Appends documents' tokens (each followed by end-of-text) to a flat binary file."""

    def __init__(self, path: str, dtype):
        self.file = open(path, "wb")
        self.dtype = dtype
        self.tokens = self.documents = self.bytes = 0
        self.max_id = -1

    def add(self, docs: list[str], tokenizer) -> None:
        for doc, ids in zip(docs, encode_documents(docs, tokenizer)):
            arr = np.asarray(ids, dtype=self.dtype)
            self.max_id = max(self.max_id, int(arr.max()))
            arr.tofile(self.file)
            self.tokens += arr.size
            self.documents += 1
            self.bytes += document_bytes(doc)

    def close(self) -> dict:
        self.file.close()
        return dict(tokens=self.tokens, documents=self.documents, bytes=self.bytes)


def prepare(
    source: str,
    tokenizer_spec: str,
    out_dir: str,
    *,
    val_fraction: float = 0.02,
    hf_config: str | None = None,
    hf_split: str = "train",
    hf_field: str = "text",
    max_docs: int | None = None,
    progress: bool = True,
) -> dict:
    """Tokenizes `source` into `out_dir` (see module docstring); returns the metadata."""
    if not 0 < val_fraction < 0.5:
        raise DataError(f"val_fraction={val_fraction} must be in (0, 0.5)")
    if source.startswith("hf:"):
        every = max(2, int(round(1 / val_fraction)))

        def labeled():
            for i, doc in enumerate(hf_documents(source[3:], hf_config, hf_split, hf_field, max_docs)):
                yield ("val" if i % every == every - 1 else "train"), doc

        def bpe_sample():
            return (d for split, d in itertools.islice(labeled(), BPE_SAMPLE_DOCS) if split == "train")

        n_docs = max_docs
    else:
        paths = [builtin_path()] if source == BUILTIN else text_paths(source)
        train_docs, val_docs = file_documents(paths, val_fraction)
        train_docs = train_docs[:max_docs] if max_docs else train_docs
        if not train_docs or not val_docs:
            raise DataError(
                f"source {source!r} gave {len(train_docs)} training and {len(val_docs)} validation documents; "
                "need at least one of each (documents are separated by blank lines)"
            )

        def labeled():
            return itertools.chain((("train", d) for d in train_docs), (("val", d) for d in val_docs))

        def bpe_sample():
            return iter(train_docs)

        n_docs = len(train_docs) + len(val_docs)
    if tokenizer_spec.startswith("bpe:"):
        tokenizer = train_bpe(bpe_sample(), bpe_vocab_size(tokenizer_spec))
    else:
        tokenizer = load_tokenizer(tokenizer_spec)
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32

    out_dir = os.path.abspath(out_dir)
    tmp_dir = out_dir.rstrip("/") + ".partial"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    os.makedirs(tmp_dir)
    writers = {split: _TokenWriter(os.path.join(tmp_dir, f"{split}.bin"), dtype) for split in SPLITS}
    pending: dict[str, list[str]] = {split: [] for split in SPLITS}
    bar = tqdm(total=n_docs, desc="tokenizing", unit="doc", disable=not progress, file=sys.stderr)
    for split, doc in labeled():
        pending[split].append(doc)
        if len(pending[split]) == 256:
            writers[split].add(pending[split], tokenizer)
            bar.update(len(pending[split]))
            pending[split] = []
    for split in SPLITS:
        writers[split].add(pending[split], tokenizer)
        bar.update(len(pending[split]))
    bar.close()
    max_id = max(w.max_id for w in writers.values())
    splits = {split: w.close() for split, w in writers.items()}
    if not splits["train"]["documents"] or not splits["val"]["documents"]:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise DataError(
            f"source {source!r} gave {splits['train']['documents']} training and {splits['val']['documents']} "
            "validation documents; need at least one of each"
        )
    if tokenizer.to_json() is not None:
        with open(os.path.join(tmp_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
            f.write(tokenizer.to_json())
    meta = dict(
        format=DATASET_FORMAT,
        source=source,
        tokenizer=tokenizer.spec,
        vocab_size=tokenizer.vocab_size,
        eos_id=tokenizer.eos_id,
        dtype=np.dtype(dtype).name,
        splits=splits,
        max_token_id=max_id,
        tokenizer_sha256=tokenizer_sha256(tokenizer.spec, tokenizer.to_json()),
    )
    with open(os.path.join(tmp_dir, "meta.json"), "w") as f:
        f.write(dumps_meta(meta))
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp_dir, out_dir)
    return meta


def main(argv):
    del argv
    if not _OUT.value:
        raise app.UsageError("--out is required")
    try:
        meta = prepare(
            _SOURCE.value,
            _TOKENIZER.value,
            _OUT.value,
            val_fraction=_VAL.value,
            hf_config=_HF_CONFIG.value,
            hf_split=_HF_SPLIT.value,
            hf_field=_HF_FIELD.value,
            max_docs=_MAX_DOCS.value,
        )
    except (DataError, FileNotFoundError, ValueError) as err:
        sys.exit(f"error: {err}")
    print(json.dumps(meta["splits"]), "->", os.path.abspath(_OUT.value))


def cli() -> None:
    """The command line (`python -m deltares.data.prepare`, `deltares-prepare`); flags only here, so modules
    import side by side."""
    global _SOURCE, _TOKENIZER, _OUT, _VAL, _HF_CONFIG, _HF_SPLIT, _HF_FIELD, _MAX_DOCS
    _SOURCE = flags.DEFINE_string("source", BUILTIN, "builtin, text files or globs (comma-separated), or hf:NAME.")
    _TOKENIZER = flags.DEFINE_string("tokenizer", "gpt2", "bytes, gpt2, hf:PATH or bpe:VOCAB.")
    _OUT = flags.DEFINE_string("out", None, "Output directory.")
    _VAL = flags.DEFINE_float("val_fraction", 0.02, "Fraction of documents held out for validation.")
    _HF_CONFIG = flags.DEFINE_string("hf_config", None, "Hugging Face dataset configuration name.")
    _HF_SPLIT = flags.DEFINE_string("hf_split", "train", "Hugging Face dataset split to stream.")
    _HF_FIELD = flags.DEFINE_string("hf_field", "text", "Record field holding the text.")
    _MAX_DOCS = flags.DEFINE_integer("max_docs", None, "Stop after this many documents.")
    from deltares import entry

    entry.run(main)


if __name__ == "__main__":
    cli()
