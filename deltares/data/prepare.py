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
prepare that was killed resumes without redoing it (and says how many units were done); the ledger
holds what the unit read (its file's size and modification time, a fingerprint of its documents),
and a unit whose source changed since is named and tokenized again, also in a complete dataset.
Whatever the workers or shards, the token stream is the same: the units' documents in source order.
The workers end with this process however it ends (SIGKILL too), and a Ctrl-C while they start or
work is the parent's one line.

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
Where `--out` may be is deltares.common.outputs' to say, with or without `--overwrite`: never a source,
inside one or around one, never a run, a model or a folder holding one, nor inside a run, a dataset or
a model (a link is followed: its target is replaced). One prepare writes an `--out` at a time: it holds
the lock `<out>.lock` beside it (see `_lock`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import functools
import hashlib
import json
import multiprocessing
import os
import re
import signal
import sys
import threading
import time

import numpy as np
from absl import app, flags
from etils import epath
from tqdm import tqdm

from deltares.common import interrupts
from deltares.common.domains import Domain
from deltares.common.inputs import bucket_filesystem
from deltares.common.lock import FileLock, LockError, describe, read_record
from deltares.common.outputs import DATASET, OutputError, check_output, is_remote, within
from deltares.data import paths
from deltares.data import documents
from deltares.data.documents import (
    BUILTIN, UNIT_BYTES, DataError, Piece, builtin_path, count_documents, hf_dataset_folder, is_records,
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
    counts as done only when its files are whole), with what it read (`_file_state`, `_Fingerprint`). Runs
    in a worker process."""
    tokenizer = _unit_tokenizer(plan["tokenizer"], tokenizer_json)
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32
    start = time.perf_counter()
    before = _file_state(plan["units"][index])
    writers = {split: ShardWriter(out_dir, split, index, dtype, tokenizer.vocab_size) for split in SPLITS}
    batch: list[Piece] = []
    size = records = 0
    fingerprint = _Fingerprint()

    def encode():
        texts = [p.text for p in batch]
        for piece, piece_ids in zip(batch, encode_texts(texts, tokenizer)):
            writers[piece.split].add(piece_ids, piece.last, documents.piece_bytes(piece), tokenizer.eos_id)

    for piece in unit_pieces(plan, index):
        fingerprint.add(piece)
        batch.append(piece)
        size += len(piece.text)
        records += piece.last
        if size >= ENCODE_BATCH_BYTES or len(batch) >= 1024:
            encode()
            batch, size = [], 0
    encode()
    if _file_state(plan["units"][index]) != before:
        raise DataError(f"{_unit_path(plan['units'][index])} changed while unit {index} was read from it; "
                        "run prepare again once it is written")
    splits = {split: w.close() for split, w in writers.items()}
    ledger = epath.Path(out_dir) / "ledger"
    ledger.mkdir(parents=True, exist_ok=True)
    with (ledger / f"{index:05d}.unigram.npz").open("wb") as f:
        np.savez(f, **{split: _sparse(writers[split].unigram) for split in SPLITS})
    record = dict(unit=index, splits=splits, documents=records,
                  max_token_id=max(w.max_id for w in writers.values()), seconds=time.perf_counter() - start,
                  source={**before, "fingerprint": fingerprint.hexdigest()})
    paths.write_text_atomic(ledger / f"{index:05d}.json", json.dumps(record))
    _release_memory()
    return record


# ----------------------------------------------------------------------------- what a unit read


class _Fingerprint:
    """A digest of the documents a unit read, piece by piece (their text and where each document ends)."""

    def __init__(self):
        self._hash = hashlib.blake2b(digest_size=16)

    def add(self, piece: Piece) -> None:
        data = piece.text.encode("utf-8")
        self._hash.update(len(data).to_bytes(8, "little") + data + (b"\1" if piece.last else b"\0"))

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def _unit_path(unit: dict) -> str:
    return builtin_path() if unit["path"] == BUILTIN else unit["path"]


def _file_state(unit: dict) -> dict:
    """The size and modification time of the file a unit reads (a bucket's or the Hub's object: its size
    and version, as its filesystem reports them)."""
    path = _unit_path(unit)
    if "://" not in path:
        stat = os.stat(path)
        return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    info = bucket_filesystem(path)[0].info(path)
    version = next((str(info[k]) for k in ("generation", "etag", "ETag", "blob_id", "mtime", "updated",
                                            "LastModified") if info.get(k) is not None), None)
    return {"size": info.get("size"), "version": version}


def _source_change(plan: dict, index: int, recorded: dict) -> str | None:
    """How the source of finished unit `index` changed since the ledger's `recorded` read of it (its size, its
    version on a bucket, the fingerprint of its documents), in words; None when it reads the same. A local
    file is read again (nothing is tokenized) to compare its content."""
    unit = plan["units"][index]
    now = _file_state(unit)
    if now.get("size") != recorded.get("size"):
        return f"its size went from {recorded.get('size')} to {now.get('size')} bytes"
    if "version" in recorded and now.get("version") != recorded["version"]:
        return "a new version of it was written"
    if "://" in _unit_path(unit):
        return None
    fingerprint = _Fingerprint()
    for piece in unit_pieces(plan, index):
        fingerprint.add(piece)
    if fingerprint.hexdigest() == recorded.get("fingerprint"):
        return None
    if now.get("mtime_ns") == recorded.get("mtime_ns"):
        return "its text changed (its size and modification time did not)"
    return "its text changed"


def _check_unit(args) -> tuple[int, str | None]:
    plan, index, recorded = args
    return index, _source_change(plan, index, recorded)


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


# ----------------------------------------------------------------------------- the workers


PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent ends (Linux)


def _worker_init(threads: int, parent: int) -> None:
    """A worker process: its share of the cores for the tokenizer's own threads, and an end with its parent.
    Ctrl-C, sent to every process of the terminal's group, is left to the parent (which ends the workers and
    prints one line): the worker started with SIGINT blocked (`_Workers`), and ignores it from now on."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # one sent while it started is dropped
    _end_with(parent)
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
    _limit_arenas()


def _end_with(parent: int) -> None:
    """This worker ends when the process `parent` ends, however it ends (SIGKILL too): the kernel kills it
    (PR_SET_PDEATHSIG, Linux), and a thread watching the pipe from the parent, which closes when the
    parent ends, ends it elsewhere."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:  # it ended before the line above
        os._exit(1)
    sentinel = getattr(multiprocessing.parent_process(), "sentinel", None)
    if sentinel is not None:
        def watch():
            from multiprocessing.connection import wait  # noqa: PLC0415

            wait([sentinel])
            os._exit(1)

        threading.Thread(target=watch, name="deltares-parent-watch", daemon=True).start()


def _run_unit(args):
    return tokenize_unit(*args)


class _Workers:
    """Runs a function over many arguments, results in the order they finish: here when `workers` is 1,
    else in `workers` spawned processes, started on first use and ended with the block (`with`). They
    start with SIGINT blocked, so that a Ctrl-C while they import ends none of them with a traceback
    (the parent handles it), and end with the parent however it ends (`_end_with`). A process pool that
    replaces a worker that died (multiprocessing.Pool) would start new ones as an interrupted parent ends
    its workers; this one does not."""

    def __init__(self, workers: int):
        self.workers, self.executor, self.processes = workers, None, []

    def imap(self, fn, args: list):
        if self.workers == 1 or not args:
            _limit_arenas()
            yield from map(fn, args)
            return
        futures = self._submit(fn, args)
        try:
            for future in concurrent.futures.as_completed(futures):
                yield future.result()
        except concurrent.futures.process.BrokenProcessPool:
            with interrupts.whole():  # an interrupt that ended the workers holds it: the process ends from there
                pass
            raise DataError("a worker process of prepare died (out of memory? see the system log); run the same "
                            "command again to resume, with fewer --workers if it was memory") from None
        finally:
            for future in futures:
                future.cancel()

    def _submit(self, fn, args: list) -> list:
        from multiprocessing import resource_tracker  # noqa: PLC0415

        resource_tracker.ensure_running()  # started before SIGINT is blocked: starting it unblocks SIGINT
        sigmask = getattr(signal, "pthread_sigmask", None)
        blocked = sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if sigmask else None
        try:
            with interrupts.whole():  # an interrupt ends this process only once each worker has what it needs
                if self.executor is None:
                    threads = max(1, (os.cpu_count() or 1) // self.workers)
                    self.executor = concurrent.futures.ProcessPoolExecutor(
                        self.workers, multiprocessing.get_context("spawn"), _worker_init, (threads, os.getpid()))
                before = set(multiprocessing.active_children())
                futures = [self.executor.submit(fn, a) for a in args]  # starts the workers
                self.processes += [p for p in multiprocessing.active_children() if p not in before]
                return futures
        finally:
            if blocked is not None:
                sigmask(signal.SIG_SETMASK, blocked)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.executor is None:
            return
        if exc[0] is None:
            self.executor.shutdown(wait=True)
        else:  # a failed unit or an interrupt: the others are not waited for
            self.executor.shutdown(wait=False, cancel_futures=True)
            for process in self.processes:
                process.kill()
            for process in self.processes:
                process.join(timeout=10)
        self.executor, self.processes = None, []


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
    run: str | None = None,
) -> dict | None:
    """Tokenizes `source` into `out_dir` (see the module docstring); returns the metadata, or None when
    other shards' units are still to do (another host writes meta.json). `run`: the run directory that
    `out_dir` belongs to (the trainer preparing its built-in corpus into `<run>/dataset`), written through
    that path (the run directory held open: deltares.training.workdir.WorkdirLock.through)."""
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
    plan = make_plan(source, tokenizer_spec, val_fraction, hf_config=hf_config, hf_split=hf_split,
                     text_field=text_field, max_docs=max_docs, unit_bytes=unit_bytes)
    if plan["units"] == []:
        raise DataError(f"source {source!r} holds no documents")
    try:
        real = check_output(out_dir, writes="folder", inputs=source_inputs(source, plan), replaces=(DATASET,),
                            owner=run)
    except OutputError as err:
        raise DataError(str(err)) from None
    if run is not None and not is_remote(run) and within(real, os.path.realpath(run)):
        real = os.path.join(run, os.path.relpath(real, os.path.realpath(run)))  # through the path the run gave
    out = epath.Path(real)
    lock = _lock(os.fspath(out), plan, shard)
    try:
        work = _workspace(out, plan, overwrite)
        with _Workers(workers) as pool:
            _redo_changed(work, plan, shard, num_shards, pool)
            meta = _finished(work)
            if meta is None:
                created = not work.exists()
                try:
                    meta = _prepare(work, plan, tokenizer_spec, pool, shard, num_shards, progress)
                except DataError:
                    if created:  # bad input, found while reading: the directory this call made goes again
                        work.rmtree(missing_ok=True)
                    raise
            elif work == out:
                _say(f"{out} already holds this dataset; nothing to do")
        if meta is not None and work != out:
            paths.swap_in(work, out)  # complete: only now is what `out` held deleted
        return meta
    finally:
        lock.release()


def source_inputs(source: str, plan: dict) -> list[str]:
    """What a prepare of `source` reads, for deltares.common.outputs.check_output: the local files of its
    plan (absolute real paths, as deltares.common.inputs resolves them), and a local Hugging Face dataset
    folder."""
    found = {u["path"] for u in plan["units"] if os.path.isabs(u["path"])}
    folder = os.path.expanduser(source[3:] if source.startswith("hf:") else source)
    if "," not in source and hf_dataset_folder(folder):
        found.add(os.path.realpath(folder))
    return sorted(found)


def _digest(plan: dict) -> str:
    return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:16]


def _lock(out: str, plan: dict, shard: int) -> FileLock:
    """This prepare's lock on `out` (deltares.common.lock): the file `<out>.lock` beside it (`<out>.lock-I`
    for shard I of a pod, whose hosts prepare one plan at once), its record naming the plan by a digest. A
    prepare of the same plan and shard waits for the holder to end; of another plan it refuses, as it does
    when a live lock of another plan lies beside its own (another shard's)."""
    digest = _digest(plan)
    lock = FileLock(f"{out}.lock" + (f"-{shard}" if shard else ""), out, holder="prepare", flag="--out",
                    extra={"plan": digest}, log=lambda message: print(message, file=sys.stderr, flush=True))
    epath.Path(out).parent.mkdir(parents=True, exist_ok=True)
    waiting = False
    while True:
        try:
            lock.acquire()
            break
        except LockError as err:
            holder = read_record(lock.path) or {}
            if holder.get("plan") != digest:
                raise DataError(str(err)) from None
            if not waiting:
                _say(f"waiting for {describe(holder, 'a prepare that is starting')}, which prepares the same data "
                     f"into {out}")
                waiting = True
            time.sleep(1.0)
    name = re.compile(re.escape(os.path.basename(out)) + r"\.lock(-\d+)?$")
    for other in epath.Path(out).parent.glob(os.path.basename(out) + ".lock*"):
        holder = read_record(other) if name.match(other.name) and other.name != lock.path.name else None
        if holder is not None and holder.get("plan") != digest and (not holder or lock.stale(holder) is None):
            lock.release()
            raise DataError(f"{out} is being prepared from other input ({describe(holder, 'a prepare that is starting')}); "
                            "wait for it to end or stop it, or use another --out")
    return lock


def _redo_changed(work: epath.Path, plan: dict, shard: int, num_shards: int, pool: _Workers) -> None:
    """Checks the source of this shard's finished units against what their ledger records say they read
    (`_source_change`); a unit whose source changed is named in a warning and tokenized again (its
    record deleted, and meta.json first: the dataset is no longer complete)."""
    done = _done(work)
    mine = [(plan, i, done[i]["source"]) for i in sorted(done)
            if i % num_shards == shard and i < len(plan["units"]) and isinstance(done[i].get("source"), dict)]
    changed = sorted((i, why) for i, why in pool.imap(_check_unit, mine) if why)
    if not changed:
        return
    for i, why in changed[:10]:
        print(f"warning: {_unit_path(plan['units'][i])} changed since unit {i} was tokenized from it ({why}); "
              "tokenizing it again", file=sys.stderr, flush=True)
    if len(changed) > 10:
        print(f"warning: and {len(changed) - 10} more units whose source changed; tokenizing them again",
              file=sys.stderr, flush=True)
    (work / "meta.json").unlink(missing_ok=True)
    for i, _ in changed:
        for suffix in (".json", ".unigram.npz"):
            (work / "ledger" / f"{i:05d}{suffix}").unlink(missing_ok=True)


def _say(message: str) -> None:
    print(f"prepare: {message}", file=sys.stderr, flush=True)


def _prepare(out: epath.Path, plan: dict, tokenizer_spec: str, pool: _Workers, shard: int, num_shards: int,
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
    _tokenize(out, plan, tokenizer_json, pool, shard, num_shards, progress)
    if json.loads((out / "plan.json").read_text()) != json.loads(json.dumps(plan)):
        raise DataError(f"{out} was prepared from other input by another process while this one ran; its tokens "
                        "are not this source's")
    done = _done(out)
    n_units = len(plan["units"])
    if any(i not in done for i in range(n_units)):
        return None
    return _finalize(out, plan, tokenizer, done, n_units)


def _tokenize(out: epath.Path, plan: dict, tokenizer_json, pool: _Workers, shard: int, num_shards: int,
              progress: bool) -> None:
    """Tokenizes this shard's units that the ledger does not hold, on the `pool`'s workers."""
    done = _done(out)
    total = len(plan["units"])
    if done:
        _say(f"resuming {out}: {len(done)} of {total} units already done")
    mine = [i for i in range(total) if i % num_shards == shard and i not in done]
    bar = tqdm(total=len(mine), desc="tokenizing", unit="unit", disable=not progress, file=sys.stderr)
    tokens = 0
    try:
        for record in pool.imap(_run_unit, [(os.fspath(out), plan, i, tokenizer_json) for i in mine]):
            tokens += sum(s["tokens"] for s in record["splits"].values())
            bar.update(1)
            bar.set_postfix(tokens=f"{tokens:,}", refresh=False)
    finally:
        bar.close()


def main(argv):
    if len(argv) > 1:  # most often a glob the shell expanded: --source took only its first file
        sys.exit(f"error: unexpected arguments {' '.join(argv[1:3])}{' ...' if len(argv) > 3 else ''}; quote a glob "
                 "so that the shell does not expand it: --source 'corpus/*.parquet'")
    if not _OUT.value:
        raise app.UsageError("--out is required")
    from deltares import command_line  # noqa: PLC0415 - the command line's own

    command_line.interrupt_note(f"preparing {_OUT.value}", "the units done are kept: the same command resumes")
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
                                   "other files): built beside it in <out>.partial, swapped in when complete; never "
                                   "a source, a run, a model or a folder holding one.")
    command_line.run(main)


if __name__ == "__main__":
    cli()
