"""Benchmark of the data path: preparing text, Parquet and JSON Lines (.zst) at 100 MB and 1 GB with
1 and 2 workers and 1 and 2 shards, and reading training windows from a local disk and from a (fake) bucket.

    python -m tests.bench_data --corpora ../shared/corpora            # the whole benchmark (about 40 minutes on 2 cores)
    python -m tests.bench_data --sizes 20 --workers 1 --read_seconds 5   # a quick look

The text is built from the corpora (`*.txt.gz`): their paragraphs repeated and shuffled, one
document without blank lines (50 MB; 5 MB below 500 MB of text, a tenth of it below 50 MB) at the
middle of the first file, split over files of 64 MB. The records (`--formats parquet,jsonl.zst`)
are documents of the same paragraphs (1 to 8 of them, every 50th record empty, one long document
in the first file), in 40 files (Parquet in row groups of 256 records; JSON Lines compressed with
zstd). Each prepare runs as its own process (`deltares.data.prepare`, the GPT-2 tokenizer; two
shards are two processes, one after the other, into one directory) and is measured from outside:
wall time, CPU seconds of the process and its workers, and peak resident memory (the largest sum
over the process tree, sampled every 50 ms). A prepare of records runs under `tests.read_counts`,
which counts every record its reader hands on in every process: the table says whether each
record of the source was read exactly once, and whether the token files are identical to those of
the first run of that source.
Reading: windows of 2048 + 1 tokens in batches of 32 through the trainer's pipeline (shuffled,
prefetched), from the prepared dataset on disk and from a copy served as `gs://` by fsspec's local
filesystem with 1 ms of latency added to every request; tokens per second over `--read_seconds`.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FILE_BYTES = 64 << 20
RECORD_FILES = 40
SOURCES = {"text": "*.txt", "parquet": "*.parquet", "jsonl.zst": "*.jsonl.zst"}


def corpus_paragraphs(corpora: str) -> list[str]:
    paragraphs = []
    for path in sorted(glob.glob(os.path.join(corpora, "*.txt.gz"))) or [os.path.join(
            ROOT, "deltares", "data", "assets", "mobydick.txt.gz")]:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            paragraphs += [p.strip() for p in re.split(r"\n\s*\n", f.read()) if p.strip()]
    return paragraphs


def build_text(corpora: str, n_bytes: int, out_dir: str, seed: int = 0) -> int:
    """`n_bytes` of text in files of FILE_BYTES: shuffled paragraphs of the corpora, repeated, with one
    long document without blank lines. Returns the bytes written."""
    paragraphs = corpus_paragraphs(corpora)
    rng = random.Random(seed)
    long_bytes = (50 << 20) if n_bytes >= (500 << 20) else min(5 << 20, n_bytes // 10)
    os.makedirs(out_dir, exist_ok=True)
    written, index, long_done = 0, 0, False
    while written < n_bytes:
        path = os.path.join(out_dir, f"part{index:04d}.txt")
        with open(path, "w", encoding="utf-8") as f:
            size = 0
            while size < min(FILE_BYTES, n_bytes - written):
                if not long_done and size > FILE_BYTES // 2 - long_bytes // 2 or (not long_done and n_bytes < FILE_BYTES
                                                                                 and size > n_bytes // 3):
                    lines, length = [], 0
                    while length < long_bytes:
                        line = rng.choice(paragraphs).replace("\n", " ")
                        lines.append(line)
                        length += len(line) + 1
                    text, long_done = "\n".join(lines) + "\n\n", True
                else:
                    text = rng.choice(paragraphs) + "\n\n"
                f.write(text)
                size += len(text.encode("utf-8"))
        written += size
        index += 1
    return written


def build_records(corpora: str, n_bytes: int, out_dir: str, fmt: str, seed: int = 0) -> tuple[int, collections.Counter]:
    """About `n_bytes` of documents as records in RECORD_FILES files of format `fmt` (parquet or
    jsonl.zst): each 1 to 8 shuffled paragraphs of the corpora, every 50th record empty, one long
    document (5 MB, or a tenth of the text below 50 MB) in the first file. Returns the text bytes
    written and the digest of every record (tests.read_counts), empty ones included."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sys.path.insert(0, ROOT)
    from tests.read_counts import digest

    paragraphs = corpus_paragraphs(corpora)
    rng = random.Random(seed)
    os.makedirs(out_dir, exist_ok=True)
    written, digests = 0, collections.Counter()
    for index in range(RECORD_FILES):
        texts, size = [], 0
        if index == 0:
            long, length = [], 0
            while length < min(5 << 20, n_bytes // 10):
                long.append(rng.choice(paragraphs))
                length += len(long[-1]) + 2
            texts.append("\n\n".join(long))
            size += length
        while size < n_bytes // RECORD_FILES:
            empty = len(texts) % 50 == 49
            text = "" if empty else "\n\n".join(rng.choice(paragraphs) for _ in range(rng.randint(1, 8)))
            texts.append(text)
            size += len(text.encode("utf-8"))
        path = os.path.join(out_dir, f"part{index:04d}.{fmt}")
        if fmt == "parquet":
            pq.write_table(pa.table({"text": texts}), path, row_group_size=256)
        else:
            with pa.CompressedOutputStream(path, "zstd") as f:
                f.write("".join(json.dumps({"text": t}) + "\n" for t in texts).encode("utf-8"))
        written += size
        digests.update(map(digest, texts))
    return written, digests


def tokens_digest(out: str) -> str:
    """The SHA-256 of a prepared dataset's token files in order (train, then validation)."""
    with open(os.path.join(out, "meta.json")) as f:
        meta = json.load(f)
    h = hashlib.sha256()
    for split in ("train", "val"):
        for name, _ in meta["splits"][split]["shards"]:
            with open(os.path.join(out, name + ".bin"), "rb") as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
    return h.hexdigest()


def measure(cmd: list[str], env: dict) -> dict:
    """Wall seconds, CPU seconds (with children) and the peak resident memory of the process tree."""
    start = time.perf_counter()
    before = os.times()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_rss(proc.pid))
        time.sleep(0.05)
    out, err = proc.communicate()
    after = os.times()
    if proc.returncode:
        raise SystemExit(f"error: {' '.join(cmd)} failed:\n{err[-2000:]}")
    return dict(wall=time.perf_counter() - start, cpu=(after.children_user + after.children_system)
                - (before.children_user + before.children_system), peak=peak, out=out)


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and its descendants (Linux /proc)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                children.setdefault(int(fields[1]), []).append(int(entry))
            except OSError:
                continue
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            continue
    return total


def read_throughput(dataset: str, seconds: float, latency: float | None) -> float:
    """Tokens per second through the trainer's pipeline (windows of 2048 + 1, batches of 32)."""
    sys.path.insert(0, ROOT)
    from deltares.data.dataset import TokenData, train_dataset, train_iterator

    if latency is not None:
        import fsspec

        sys.path.insert(0, HERE)
        from fake_bucket import local_bucket

        root = os.path.dirname(os.path.abspath(dataset))  # gs://NAME is the dataset directory NAME under root
        for name in ("gs", "gcs"):
            fsspec.register_implementation(name, local_bucket(root, latency), clobber=True)
        from etils.epath import backend

        backend.fsspec_backend._get_filesystem.cache_clear()
        dataset = "gs://" + os.path.basename(os.path.abspath(dataset))
    tokens = TokenData(dataset).tokens("train")
    it = train_iterator(train_dataset(tokens, 2048, 32, seed=0), prefetch=4)
    next(it)
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        n += next(it).shape[0] * 2048
    return n / (time.perf_counter() - start)


def prepare_run(source: str, out: str, workers: int, shards: int, counts: str | None, env: dict) -> dict:
    """One prepare, measured: `shards` processes one after another (the last one writes meta.json),
    under tests.read_counts when `counts` names a counts file."""
    runs = []
    for shard in reversed(range(shards)):
        cmd = [sys.executable, "-m", "deltares.data.prepare"] if counts is None else [
            sys.executable, "-m", "tests.read_counts", counts]
        cmd += ["--source", source, "--tokenizer", "gpt2", "--out", out, "--workers", str(workers)]
        if shards > 1:
            cmd += ["--shard", str(shard), "--num_shards", str(shards)]
        runs.append(measure(cmd, env))
    return dict(wall=sum(r["wall"] for r in runs), cpu=sum(r["cpu"] for r in runs), peak=max(r["peak"] for r in runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpora", default=os.path.join(ROOT, "..", "shared", "corpora"))
    parser.add_argument("--sizes", default="100,1000", help="text sizes in MB, comma-separated")
    parser.add_argument("--formats", default="text,parquet,jsonl.zst", help="source formats, comma-separated")
    parser.add_argument("--workers", default="1,2", help="worker counts (one shard), comma-separated")
    parser.add_argument("--shards", default="1,2", help="shard counts (one worker each), comma-separated")
    parser.add_argument("--read_seconds", type=float, default=20.0)
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    runs = [(int(w), 1) for w in args.workers.split(",")]
    runs += [(1, int(n)) for n in args.shards.split(",") if int(n) > 1 or (1, int(n)) not in runs]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        last = None
        for size in (int(s) for s in args.sizes.split(",")):
            for fmt in args.formats.split(","):
                if fmt not in SOURCES:
                    raise SystemExit(f"error: --formats: {fmt!r} is none of {', '.join(SOURCES)}")
                src_dir = os.path.join(tmp, f"{fmt}{size}")
                if fmt == "text":
                    n_bytes, digests = build_text(args.corpora, size << 20, src_dir), None
                else:
                    n_bytes, digests = build_records(args.corpora, size << 20, src_dir, fmt)
                first = None
                for workers, shards in runs:
                    out = os.path.join(tmp, f"ds{size}_{fmt}_{workers}_{shards}")
                    counts = None if digests is None else out + ".counts"
                    print(f"preparing {n_bytes / 2**20:.0f} MB of {fmt} with {workers} worker(s), {shards} "
                          "shard(s) ...", file=sys.stderr, flush=True)
                    m = prepare_run(os.path.join(src_dir, SOURCES[fmt]), out, workers, shards, counts, env)
                    with open(os.path.join(out, "meta.json")) as f:
                        meta = json.load(f)
                    tokens = sum(meta["splits"][s]["tokens"] for s in ("train", "val"))
                    if digests is None:
                        once = "-"
                    else:
                        from tests.read_counts import read_counts

                        once = "yes" if read_counts(counts) == digests else "NO"
                    same = tokens_digest(out)
                    first = first or same
                    rows.append(dict(size=n_bytes, fmt=fmt, workers=workers, shards=shards, tokens=tokens,
                                     once=once, same="yes" if same == first else "NO", **m))
                    last = out
                    print(f"  {m['wall']:.0f} s wall, {m['cpu']:.0f} CPU s, peak {m['peak'] / 2**20:.0f} MB, "
                          f"{tokens / m['cpu']:,.0f} tokens per CPU-second", file=sys.stderr, flush=True)
                shutil.rmtree(src_dir)
        print("| source | workers | shards | tokens | read once | same tokens | wall s | CPU s | wall / CPU | "
              "tokens per CPU-s | peak RSS (tree) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['size'] / 2**20:,.0f} MB {r['fmt']} | {r['workers']} | {r['shards']} | {r['tokens']:,} | "
                  f"{r['once']} | {r['same']} | {r['wall']:.0f} | {r['cpu']:.0f} | {r['wall'] / r['cpu']:.2f} | "
                  f"{r['tokens'] / r['cpu']:,.0f} | {r['peak'] / 2**20:,.0f} MB |")
        local = read_throughput(last, args.read_seconds, None)
        remote = read_throughput(last, args.read_seconds, 0.001)
        print(f"\nreading windows of 2048 + 1 tokens, batches of 32: local disk {local:,.0f} tokens/s; "
              f"fake bucket with 1 ms per request {remote:,.0f} tokens/s")
        if any(r["once"] == "NO" or r["same"] == "NO" for r in rows):
            raise SystemExit("error: a record was not read exactly once, or the token files differ between runs")


if __name__ == "__main__":
    main()
