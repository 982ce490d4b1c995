"""Tokenize a corpus once into sharded token files with a held-out validation split.

    python -m deltares.data.prepare --source builtin --tokenizer bpe:4096 --out data/moby
    python -m deltares.data.prepare --source 'corpora/*.txt.gz' --tokenizer gpt2 --out data/pd --workers 2
    python -m deltares.data.prepare --source 'corpus/*.parquet' --text_field text --tokenizer gpt2 --out data/c --workers 2
    python -m deltares.data.prepare --source hf:HuggingFaceFW/fineweb-edu --hf_config sample-10BT \
        --tokenizer hf:/models/Qwen3-0.6B --max_docs 2000000 --out data/fwe

The source is read lazily in units (deltares.data.documents: plain text files cut at blank lines into
pieces of about 64 MB, a compressed text file, a JSON Lines or Arrow file whole, a Parquet file whole or in
runs of row groups, a Hugging Face dataset by its own data files), so memory stays bounded however
large the corpus, and every record is read by one unit only. `--workers N` tokenizes N units at once in N
processes. `--shard I --num_shards N` tokenizes only the units I, I + N, ... : every host of a pod
runs it with its own I into the same output directory (a local path or a bucket), and the host that
finishes the last unit writes `meta.json`. Each finished unit is recorded in a ledger, so a
prepare that was killed resumes without redoing it (and says how many units were done). Whatever
the workers or shards, the token stream is the same: the units' documents in source order.

The output directory (format 2, see deltares.data.shards for the token files):
- `train/<unit>.bin`, `val/<unit>.bin`: every document's tokens followed by end-of-text;
- `meta.json`: format, source, tokenizer spec and fingerprint (`tokenizer_sha256`), vocabulary
  size, end-of-text id, token dtype, the largest token id (`max_token_id`), and per split the
  number of tokens, documents and UTF-8 bytes (for bits per byte) and its shards; written last,
  so a directory without it is no dataset;
- `unigram.npy`: int64 [2, vocab] token counts of the train and validation splits;
- `tokenizer.json` (when the tokenizer is not `bytes`), `plan.json` (what was asked: source,
  tokenizer, units) and `ledger/` (one record per finished unit).

A document is held out for validation when a hash of its text says so (`--val_fraction` of them),
whichever file or record it comes from. `--max_docs N` keeps the first N documents of the source,
held-out ones included (a non-empty record is a document; counting them reads the text of the
units it keeps once more). `bpe:N` trains its tokenizer on the first 20,000 training documents.

An `--out` that holds anything but this input's dataset (whole or in part) is refused; with `--overwrite`
the new dataset is built in `<out>.partial` beside it and swapped in only when complete, so a source
that fails leaves the old dataset whole (a killed one is resumed by the same command). On a bucket,
which cannot rename a folder, the old dataset is deleted and the new one moved in only once it is complete.
"""

from __future__ import annotations

import ctypes
import functools
import json
import multiprocessing
import os
import signal
import sys
import time

import numpy as np
from absl import app, flags
from etils import epath
from tqdm import tqdm

from deltares.common.domains import Domain
from deltares.data import paths
from deltares.data import documents
from deltares.data.documents import (
    BUILTIN, UNIT_BYTES, DataError, Piece, count_documents, hf_dataset_folder, is_records,
    source_units,
)
from deltares.data.shards import ShardWriter
from deltares.data.tokenizer import bpe_vocab_size, dumps_meta, encode_texts, load_tokenizer, tokenizer_sha256, train_bpe

DATASET_FORMAT = 2
READABLE_FORMATS = (1, 2)  # format 1: one train.bin / val.bin (datasets prepared before shards)
SPLITS = ("train", "val")
BPE_SAMPLE_DOCS = 20000
BPE_SAMPLE_BYTES = 256 << 20
ENCODE_BATCH_BYTES = 512 << 10
VAL_FRACTION = Domain(0, 0.5, low_open=True, high_open=True)  # --val_fraction: some of both splits


# ----------------------------------------------------------------------------- the plan


def make_plan(source: str, tokenizer_spec: str, val_fraction: float, *, hf_config=None, hf_split="train",
              text_field="text", max_docs=None, unit_bytes=UNIT_BYTES) -> dict:
    """What is prepared, fixed before anything is tokenized: the source's units and the settings that
    decide the token stream. A prepare into a directory holding another plan refuses (see `prepare`)."""
    plan = dict(format=DATASET_FORMAT, source=source, tokenizer=tokenizer_spec, val_fraction=val_fraction,
                max_docs=max_docs)
    if source.startswith("hf:") or hf_dataset_folder(source):
        plan["hf"] = dict(config=hf_config, split=hf_split)
    units = source_units(source, flag="--source", text_field=text_field, hf_config=hf_config, hf_split=hf_split,
                         unit_bytes=unit_bytes)
    if any(is_records(u) for u in units):
        plan["text_field"] = text_field
    if max_docs:
        for unit, limit in zip(units, count_documents(units, max_docs, text_field)):
            unit["limit"] = limit
        units = [u for u in units if u["limit"]]
    plan["units"] = units
    return plan


def unit_pieces(plan: dict, index: int):
    """The pieces of unit `index` of the plan (see deltares.data.documents)."""
    unit = plan["units"][index]
    return documents.unit_pieces(unit, plan["val_fraction"], plan.get("text_field", "text"), unit.get("limit"))


def _bpe_sample(plan: dict):
    """The first BPE_SAMPLE_DOCS training documents of the source (at most BPE_SAMPLE_BYTES), in order."""
    docs, size, parts = 0, 0, []
    for index in range(len(plan["units"])):
        for piece in unit_pieces(plan, index):
            if piece.split != "train":
                continue
            parts.append(piece.text)
            size += len(piece.text)
            if piece.last:
                yield "".join(parts)
                parts, docs = [], docs + 1
                if docs >= BPE_SAMPLE_DOCS or size >= BPE_SAMPLE_BYTES:
                    return


# ----------------------------------------------------------------------------- one unit


def tokenize_unit(out_dir: str, plan: dict, index: int, tokenizer_json: str | None) -> dict:
    """Tokenizes unit `index` into its shard files and records it in the ledger (last, so a unit
    counts as done only when its files are whole). Runs in a worker process."""
    tokenizer = _unit_tokenizer(plan["tokenizer"], tokenizer_json)
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32
    start = time.perf_counter()
    writers = {split: ShardWriter(out_dir, split, index, dtype, tokenizer.vocab_size) for split in SPLITS}
    batch: list[Piece] = []
    size = records = 0

    def encode():
        texts = [p.text for p in batch]
        for piece, piece_ids in zip(batch, encode_texts(texts, tokenizer)):
            writers[piece.split].add(piece_ids, piece.last, documents.piece_bytes(piece), tokenizer.eos_id)

    for piece in unit_pieces(plan, index):
        batch.append(piece)
        size += len(piece.text)
        records += piece.last
        if size >= ENCODE_BATCH_BYTES or len(batch) >= 1024:
            encode()
            batch, size = [], 0
    encode()
    splits = {split: w.close() for split, w in writers.items()}
    ledger = epath.Path(out_dir) / "ledger"
    ledger.mkdir(parents=True, exist_ok=True)
    with (ledger / f"{index:05d}.unigram.npz").open("wb") as f:
        np.savez(f, **{split: _sparse(writers[split].unigram) for split in SPLITS})
    record = dict(unit=index, splits=splits, documents=records,
                  max_token_id=max(w.max_id for w in writers.values()), seconds=time.perf_counter() - start)
    paths.write_text_atomic(ledger / f"{index:05d}.json", json.dumps(record))
    _release_memory()
    return record


@functools.lru_cache(maxsize=1)
def _unit_tokenizer(spec: str, tokenizer_json: str | None):
    """One tokenizer per process for all its units (loading one per unit fragments the heap)."""
    return load_tokenizer(spec, tokenizer_json)


def _glibc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return None


def _limit_arenas() -> None:
    """At most 2 malloc arenas for the tokenizer's threads: their freed memory is reused rather than
    kept per thread (measured: a 16 MB unit peaks at 171 MB instead of 212 MB, at the same speed)."""
    if (libc := _glibc()) is not None:
        libc.mallopt(-8, 2)  # M_ARENA_MAX


def _release_memory() -> None:
    """Returns the heap the tokenizer freed during a unit to the system, so that resident memory
    does not creep up unit by unit."""
    if (libc := _glibc()) is not None:
        libc.malloc_trim(0)


def _sparse(counts: np.ndarray) -> np.ndarray:
    ids = np.flatnonzero(counts)
    return np.stack([ids, counts[ids]]).astype(np.int64)


def _worker_init(threads: int) -> None:
    """A worker process: its share of the cores for the tokenizer's own threads. Ctrl-C, sent to every
    process of the terminal's group, is left to the parent (which ends the workers and prints one line)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
    _limit_arenas()


def _run_unit(args):
    return tokenize_unit(*args)


# ----------------------------------------------------------------------------- the whole


def _done(out: epath.Path) -> dict[int, dict]:
    ledger = out / "ledger"
    if not ledger.exists():
        return {}
    records = {}
    for path in ledger.iterdir():
        if path.name.endswith(".json") and path.name[:5].isdigit():
            try:
                records[int(path.name[:5])] = json.loads(path.read_text())
            except ValueError:
                continue  # cut short by a crash: redone
    return records


def _other(out: epath.Path, plan: dict) -> str | None:
    """What `out` holds instead of this plan's dataset, in words; None when it is missing, empty, or holds
    this plan's dataset (whole, or in part: a prepare to resume)."""
    plan_path = out / "plan.json"
    if plan_path.exists():
        theirs, ours = json.loads(plan_path.read_text()), json.loads(json.dumps(plan))
        if theirs == ours:
            return None
        differ = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
        return f"a dataset prepared from other input (differs in {', '.join(differ)})"
    if (out / "meta.json").exists():
        return "a dataset prepared by an earlier deltares"
    return paths.contents(out)


def _workspace(out: epath.Path, plan: dict, overwrite: bool) -> epath.Path:
    """Where this prepare writes: `out` itself when it is missing, empty or holds this plan's dataset;
    with `overwrite`, when it holds anything else, the folder beside it that is swapped in when complete
    (a leftover one of other input is deleted; one of this input is resumed, as hosts of a pod share
    it). Refused otherwise."""
    if out.exists() and not out.is_dir():
        raise DataError(f"{out} is a file; --out names a directory")
    other = _other(out, plan)
    if other is None:
        return out
    if not overwrite:
        raise DataError(f"{out} holds {other}; use a new --out, or --overwrite to replace it")
    work = epath.Path(paths.staging(out))
    if (work / "plan.json").exists() and _other(work, plan) is not None:
        work.rmtree()  # an unfinished replacement from other input: never a dataset
    return work  # without plan.json it holds at most a tokenizer.json, rewritten (or another host's: used)


def _finished(work: epath.Path) -> dict | None:
    """The metadata of the dataset in `work` when it is complete (it holds this plan: see `_workspace`)."""
    meta_path = work / "meta.json"
    return json.loads(meta_path.read_text()) if meta_path.exists() and (work / "plan.json").exists() else None


def _write_plan(out: epath.Path, plan: dict, tokenizer) -> str | None:
    """tokenizer.json, then plan.json (created once: the first host's, which the others then use).
    Returns the tokenizer JSON every unit is encoded with."""
    out.mkdir(parents=True, exist_ok=True)
    text = tokenizer.to_json()
    existing = out / "tokenizer.json"
    if text is not None and existing.exists() and (out / "plan.json").exists():
        return existing.read_text()  # another host's trained tokenizer
    if text is not None:
        paths.write_text_atomic(existing, text)
    paths.write_text_atomic(out / "plan.json", json.dumps(plan, indent=2))
    return text


def _finalize(out: epath.Path, plan: dict, tokenizer, done: dict, n_units: int) -> dict:
    """meta.json and unigram.npy of a dataset whose units are all done."""
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32
    splits = {}
    unigram = np.zeros((2, tokenizer.vocab_size), np.int64)
    for s, split in enumerate(SPLITS):
        shards = [[f"{split}/{i:05d}", done[i]["splits"][split]["tokens"]] for i in range(n_units)]
        splits[split] = {k: sum(done[i]["splits"][split][k] for i in range(n_units))
                         for k in ("tokens", "documents", "bytes")}
        splits[split]["shards"] = [s_ for s_ in shards if s_[1]]
    for i in range(n_units):
        with (out / "ledger" / f"{i:05d}.unigram.npz").open("rb") as f:
            parts = np.load(f)
            for s, split in enumerate(SPLITS):
                ids, counts = parts[split]
                unigram[s, ids] += counts
    if not splits["train"]["documents"] or not splits["val"]["documents"]:
        raise DataError(
            f"source {plan['source']!r} gave {splits['train']['documents']} training and "
            f"{splits['val']['documents']} validation documents; need at least one of each (a document is "
            "the text between blank lines, or a non-empty record; the validation split holds about val_fraction "
            "of them)"
        )
    with (out / "unigram.npy").open("wb") as f:
        np.save(f, unigram)
    meta = dict(
        format=DATASET_FORMAT,
        source=plan["source"],
        tokenizer=tokenizer.spec,
        vocab_size=tokenizer.vocab_size,
        eos_id=tokenizer.eos_id,
        dtype=np.dtype(dtype).name,
        splits=splits,
        max_token_id=max(done[i]["max_token_id"] for i in range(n_units)),
        tokenizer_sha256=tokenizer_sha256(tokenizer.spec, tokenizer.to_json()),
        val_fraction=plan["val_fraction"],
        units=n_units,
    )
    paths.write_text_atomic(out / "meta.json", dumps_meta(meta))
    return meta


def prepare(
    source: str,
    tokenizer_spec: str,
    out_dir: str,
    *,
    val_fraction: float = 0.02,
    hf_config: str | None = None,
    hf_split: str = "train",
    text_field: str = "text",
    max_docs: int | None = None,
    progress: bool = True,
    workers: int = 1,
    shard: int = 0,
    num_shards: int = 1,
    unit_bytes: int = UNIT_BYTES,
    overwrite: bool = False,
) -> dict | None:
    """Tokenizes `source` into `out_dir` (see the module docstring); returns the metadata, or None when
    other shards' units are still to do (another host writes meta.json)."""
    problem = VAL_FRACTION.problem(val_fraction)
    if problem:
        raise DataError(f"val_fraction={val_fraction} {problem}")
    if workers < 1 or num_shards < 1 or not 0 <= shard < num_shards:
        raise DataError(f"need workers >= 1 and 0 <= shard < num_shards (got {workers}, {shard}, {num_shards})")
    if max_docs is not None and max_docs < 1:
        raise DataError(f"max_docs={max_docs} must be at least 1")
    if tokenizer_spec.startswith("bpe:"):
        bpe_vocab_size(tokenizer_spec)
    elif tokenizer_spec != "bytes":
        load_tokenizer(tokenizer_spec)  # a bad spec fails before anything is read or written
    out = epath.Path(paths.run_dir(out_dir))
    plan = make_plan(source, tokenizer_spec, val_fraction, hf_config=hf_config, hf_split=hf_split,
                     text_field=text_field, max_docs=max_docs, unit_bytes=unit_bytes)
    if plan["units"] == []:
        raise DataError(f"source {source!r} holds no documents")
    work = _workspace(out, plan, overwrite)
    meta = _finished(work)
    if meta is None:
        created = not work.exists()
        try:
            meta = _prepare(work, plan, tokenizer_spec, workers, shard, num_shards, progress)
        except DataError:
            if created:  # bad input, found while reading: the directory this call made goes again
                work.rmtree(missing_ok=True)
            raise
    elif work == out:
        _say(f"{out} already holds this dataset; nothing to do")
    if meta is not None and work != out:
        paths.swap_in(work, out)  # complete: only now is what `out` held deleted
    return meta


def _say(message: str) -> None:
    print(f"prepare: {message}", file=sys.stderr, flush=True)


def _prepare(out: epath.Path, plan: dict, tokenizer_spec: str, workers: int, shard: int, num_shards: int,
             progress: bool) -> dict | None:
    if (out / "tokenizer.json").exists() and (out / "plan.json").exists():
        tokenizer_json = (out / "tokenizer.json").read_text()
    elif tokenizer_spec.startswith("bpe:"):
        tokenizer_json = train_bpe(_bpe_sample(plan), bpe_vocab_size(tokenizer_spec)).to_json()
    else:
        tokenizer_json = None
    tokenizer = load_tokenizer(tokenizer_spec, tokenizer_json)
    tokenizer_json = _write_plan(out, plan, tokenizer)
    tokenizer = load_tokenizer(tokenizer_spec, tokenizer_json)
    _tokenize(out, plan, tokenizer_json, workers, shard, num_shards, progress)
    done = _done(out)
    n_units = len(plan["units"])
    if any(i not in done for i in range(n_units)):
        return None
    return _finalize(out, plan, tokenizer, done, n_units)


def _tokenize(out: epath.Path, plan: dict, tokenizer_json, workers: int, shard: int, num_shards: int,
              progress: bool) -> None:
    """Tokenizes this shard's units that the ledger does not hold, `workers` at a time."""
    done = _done(out)
    total = len(plan["units"])
    if done:
        _say(f"resuming {out}: {len(done)} of {total} units already done")
    mine = [i for i in range(total) if i % num_shards == shard and i not in done]
    bar = tqdm(total=len(mine), desc="tokenizing", unit="unit", disable=not progress, file=sys.stderr)
    tokens = 0

    def report(record):
        nonlocal tokens
        tokens += sum(s["tokens"] for s in record["splits"].values())
        bar.update(1)
        bar.set_postfix(tokens=f"{tokens:,}", refresh=False)

    try:
        if workers == 1:
            _limit_arenas()
            for index in mine:
                report(tokenize_unit(os.fspath(out), plan, index, tokenizer_json))
            return
        threads = max(1, (os.cpu_count() or 1) // workers)
        with multiprocessing.get_context("spawn").Pool(workers, _worker_init, (threads,)) as pool:
            for record in pool.imap_unordered(_run_unit, [(os.fspath(out), plan, i, tokenizer_json) for i in mine]):
                report(record)
    finally:
        bar.close()


def main(argv):
    if len(argv) > 1:  # most often a glob the shell expanded: --source took only its first file
        sys.exit(f"error: unexpected arguments {' '.join(argv[1:3])}{' ...' if len(argv) > 3 else ''}; quote a glob "
                 "so that the shell does not expand it: --source 'corpus/*.parquet'")
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
            text_field=_TEXT_FIELD.value,
            max_docs=_MAX_DOCS.value,
            workers=_WORKERS.value,
            shard=_SHARD.value,
            num_shards=_NUM_SHARDS.value,
            overwrite=_OVERWRITE.value,
        )
    except (DataError, FileNotFoundError, ValueError) as err:
        sys.exit(f"error: {err}")
    if meta is None:
        print(f"shard {_SHARD.value} of {_NUM_SHARDS.value} done; meta.json is written by the shard that finishes "
              f"the last unit -> {paths.run_dir(_OUT.value)}")
        return
    print(json.dumps({s: {k: v for k, v in meta["splits"][s].items() if k != "shards"} for s in SPLITS}), "->",
          paths.run_dir(_OUT.value))


def cli() -> None:
    """The command line (`python -m deltares.data.prepare`, `deltares-prepare`); flags only here, so modules
    import side by side."""
    global _SOURCE, _TOKENIZER, _OUT, _VAL, _HF_CONFIG, _HF_SPLIT, _TEXT_FIELD, _MAX_DOCS, _WORKERS, _SHARD
    global _NUM_SHARDS, _OVERWRITE
    from deltares import command_line
    from deltares.common.domains import AT_LEAST_1, NON_NEGATIVE, define_number

    _SOURCE = flags.DEFINE_string("source", BUILTIN, "builtin, text, JSON Lines, Parquet or Arrow files or globs "
                                  "(comma-separated, compressed or not), hf:NAME, or a saved Hugging Face dataset.")
    _TOKENIZER = flags.DEFINE_string("tokenizer", "gpt2", "bytes, gpt2, hf:PATH or bpe:VOCAB.")
    _OUT = flags.DEFINE_string("out", None, "Output directory (a local path or a gs:// or s3:// URL).")
    _VAL = define_number(flags.DEFINE_float, "val_fraction", 0.02,
                                      "Fraction of documents held out for validation (by hash).", VAL_FRACTION)
    _HF_CONFIG = flags.DEFINE_string("hf_config", None, documents.SOURCE_HELP["hf_config"])
    _HF_SPLIT = flags.DEFINE_string("hf_split", "train", documents.SOURCE_HELP["hf_split"])
    _TEXT_FIELD = flags.DEFINE_string("text_field", "text", documents.SOURCE_HELP["text_field"])
    integer = functools.partial(define_number, flags.DEFINE_integer)
    _MAX_DOCS = integer("max_docs", None, "Keep the first N documents of the source (held-out ones included; a "
                        "non-empty record is a document).", AT_LEAST_1)
    _WORKERS = integer("workers", 1, "Processes tokenizing units at once.", AT_LEAST_1)
    _SHARD = integer("shard", 0, "This host's share of the units: I of --num_shards (less than it).", NON_NEGATIVE)
    _NUM_SHARDS = integer("num_shards", 1, "Hosts sharing the units (each runs with its --shard).", AT_LEAST_1)
    _OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace what --out holds (a dataset of other input, or "
                                   "anything else): built beside it in <out>.partial, swapped in when complete.")
    command_line.run(main)


if __name__ == "__main__":
    cli()
