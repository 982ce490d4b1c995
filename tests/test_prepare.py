"""Preparation at scale (`deltares.data.prepare`, `deltares.data.documents`, `deltares.data.shards`):
long documents encoded in pieces with the ids of the whole, a token stream independent of workers
and host shards, a ledger that lets a killed prepare resume, bounded samples, stored unigram
counts, datasets of the earlier format, datasets on a bucket, and bad input.

Expectations are independent of the code under test: whole-document encodings, a by-hand
concatenation of documents, NumPy bincounts.
"""

import gzip
import json
import os
from collections import Counter

import numpy as np
import pytest

from deltares.data import documents, prepare as prepare_module
from deltares.data.dataset import TokenData
from deltares.data.documents import DataError, builtin_path
from deltares.data.prepare import prepare
from deltares.data.tokenizer import load_tokenizer

import read_counts
from debug_runs import tree_digest
from test_data import WORDS, by_hash, make_docs, write_corpus


def moby_text(n_bytes):
    with gzip.open(builtin_path(), "rt", encoding="utf-8") as f:
        return f.read(n_bytes)


def stream(out, split):
    return np.asarray(TokenData(str(out)).tokens(split))


@pytest.mark.parametrize("joiner", ["\n", " "])
def test_long_document_pieces_encode_to_the_ids_of_the_whole(monkeypatch, joiner):
    """A document without blank lines (a book's lines joined) is read in pieces cut after a newline
    that a non-space character follows, and one without newlines (joined by spaces: one line) before
    a space that precedes a letter; with the GPT-2 tokenizer the pieces' ids are the whole's."""
    monkeypatch.setattr(documents, "PIECE_BYTES", 4096)
    text = moby_text(200_000)
    book = joiner.join(line for line in text.splitlines() if line.strip())  # one document
    unit = {"path": "book.txt", "start": 0, "end": None}
    monkeypatch.setattr(documents, "_unit_lines", lambda u: iter(book.splitlines(keepends=True)))
    pieces = list(documents.text_pieces(unit, 0.1))
    assert len(pieces) > 20 and [p.last for p in pieces].count(True) == 1 and pieces[-1].last
    assert "".join(p.text for p in pieces) == book.strip()
    assert all(p.split == pieces[0].split for p in pieces)
    assert max(len(p.text) for p in pieces[:-1]) < 4 * 4096 and np.median([len(p.text) for p in pieces]) < 2 * 4096
    gpt2 = load_tokenizer("gpt2")
    whole = gpt2.encode(book.strip())
    assert [t for p in pieces for t in gpt2.encode(p.text)] == whole
    in_memory = documents._cut(book.strip())  # a record of a Hugging Face dataset
    assert len(in_memory) > 20 and "".join(in_memory) == book.strip()
    assert [t for p in in_memory for t in gpt2.encode(p)] == whole


def test_documents_stream_like_the_whole_text(tmp_path):
    """Reading a file in units cut at blank lines gives the documents of splitting the whole text."""
    text = moby_text(400_000)
    path = tmp_path / "moby.txt"
    path.write_text(text)
    units = documents.source_units(str(path), unit_bytes=50_000)
    assert len(units) >= 6 and units[0]["start"] == 0 and units[-1]["end"] is None
    assert all(a["end"] == b["start"] for a, b in zip(units, units[1:]))
    docs, parts = [], []
    for unit in units:
        for piece in documents.text_pieces(unit, 0.1):
            parts.append(piece.text)
            if piece.last:
                docs.append("".join(parts))
                parts = []
    import re

    assert docs == [d.strip() for d in re.split(r"\n\s*\n", text) if d.strip()]


def corpus(tmp_path, n_files=3, docs_per_file=60):
    files = []
    for i in range(n_files):
        files.append(tmp_path / f"c{i}.txt")
        write_corpus(files[-1], make_docs(docs_per_file, 10 + i, f"f{i}"))
    return ",".join(map(str, files)), [d for i in range(n_files) for d in make_docs(docs_per_file, 10 + i, f"f{i}")]


def test_workers_and_shards_give_one_token_stream(tmp_path):
    source, docs = corpus(tmp_path)
    kw = dict(val_fraction=0.2, progress=False, unit_bytes=3000)
    one = prepare(source, "bytes", str(tmp_path / "one"), **kw)
    assert one["units"] >= 9
    two = prepare(source, "bytes", str(tmp_path / "two"), workers=2, **kw)
    assert prepare(source, "bytes", str(tmp_path / "hosts"), shard=1, num_shards=2, **kw) is None  # host 1 first
    assert not (tmp_path / "hosts" / "meta.json").exists()
    hosts = prepare(source, "bytes", str(tmp_path / "hosts"), shard=0, num_shards=2, **kw)
    want_train, want_val = by_hash(docs, 0.2)
    want = {"train": b"".join(d.encode() + b"\xff" for d in want_train),
            "val": b"".join(d.encode() + b"\xff" for d in want_val)}
    for out, meta in (("one", one), ("two", two), ("hosts", hosts)):
        assert meta == one
        for split in ("train", "val"):
            got = stream(tmp_path / out, split)
            assert bytes(np.where(got == 256, 255, got).astype(np.uint8)) == want[split], (out, split)


def test_killed_prepare_resumes_from_its_ledger(tmp_path, monkeypatch, capsys):
    source, _ = corpus(tmp_path)
    kw = dict(val_fraction=0.2, progress=False, unit_bytes=3000)
    clean = prepare(source, "bytes", str(tmp_path / "clean"), **kw)
    real, calls = prepare_module.tokenize_unit, []

    def dies_after_three(out, plan, index, tokenizer_json):
        if len(calls) == 3:
            raise KeyboardInterrupt  # the user's Ctrl-C in the fourth unit
        calls.append(index)
        return real(out, plan, index, tokenizer_json)

    monkeypatch.setattr(prepare_module, "tokenize_unit", dies_after_three)
    out = tmp_path / "killed"
    with pytest.raises(KeyboardInterrupt):
        prepare(source, "bytes", str(out), **kw)
    assert sorted(os.listdir(out / "ledger")) == [f"{i:05d}{ext}" for i in range(3) for ext in (".json", ".unigram.npz")]
    with pytest.raises(DataError, match="no meta.json"):
        TokenData(str(out))  # nothing a trainer would accept
    calls.clear()
    monkeypatch.setattr(prepare_module, "tokenize_unit", lambda *a: calls.append(a[2]) or real(*a))
    capsys.readouterr()
    resumed = prepare(source, "bytes", str(out), **kw)
    assert calls == list(range(3, clean["units"]))  # the finished units were not redone
    assert f"prepare: resuming {out}: 3 of {clean['units']} units already done" in capsys.readouterr().err
    assert resumed == clean
    for split in ("train", "val"):
        np.testing.assert_array_equal(stream(out, split), stream(tmp_path / "clean", split))


OVERWRITE_KW = dict(val_fraction=0.2, progress=False, unit_bytes=3000)


def old_dataset(tmp_path):
    """(the folder of a dataset prepared from a corpus of two files, the digest of its files)."""
    source, _ = corpus(tmp_path, n_files=2)
    out = tmp_path / "ds"
    prepare(source, "bytes", str(out), **OVERWRITE_KW)
    return out, tree_digest(out)


def test_overwrite_builds_beside_and_a_failing_source_leaves_the_old_dataset_whole(tmp_path):
    """`overwrite` replaces another dataset only once the new one is complete: a source that fails while
    it is read (its second file is Latin-1) leaves the old dataset's files as they were, and no partial folder."""
    out, before = old_dataset(tmp_path)
    kw = OVERWRITE_KW
    good = tmp_path / "new.txt"
    write_corpus(good, make_docs(30, 7, "new"))
    bad = tmp_path / "bad.txt"
    bad.write_bytes("caf\xe9\n\nna\xefve".encode("latin1"))
    with pytest.raises(DataError, match="bad.txt"):
        prepare(f"{good},{bad}", "bytes", str(out), overwrite=True, **kw)
    assert tree_digest(out) == before
    assert sorted(os.listdir(tmp_path)) == ["bad.txt", "c0.txt", "c1.txt", "ds", "new.txt"]  # no ds.partial
    meta = prepare(str(good), "bytes", str(out), overwrite=True, **kw)
    assert meta["source"] == str(good) and TokenData(str(out)).meta == meta
    assert "ds.partial" not in os.listdir(tmp_path) and not any(".old-" in n for n in os.listdir(tmp_path))


def test_killed_overwrite_keeps_the_old_dataset_and_resumes_beside_it(tmp_path, monkeypatch, capsys):
    out, before = old_dataset(tmp_path)
    kw = OVERWRITE_KW
    new = tmp_path / "new.txt"
    write_corpus(new, make_docs(60, 7, "new"))
    real, calls = prepare_module.tokenize_unit, []

    def dies_after_two(out_dir, plan, index, tokenizer_json):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(index)
        return real(out_dir, plan, index, tokenizer_json)

    monkeypatch.setattr(prepare_module, "tokenize_unit", dies_after_two)
    with pytest.raises(KeyboardInterrupt):
        prepare(str(new), "bytes", str(out), overwrite=True, **kw)
    assert tree_digest(out) == before  # the old dataset is still the one there, whole
    assert (tmp_path / "ds.partial" / "ledger" / "00001.json").exists()
    with pytest.raises(DataError, match="other input.*--overwrite"):
        prepare(str(new), "bytes", str(out), **kw)  # without --overwrite: refused, nothing touched
    monkeypatch.setattr(prepare_module, "tokenize_unit", real)
    capsys.readouterr()
    meta = prepare(str(new), "bytes", str(out), overwrite=True, **kw)
    assert f"resuming {tmp_path / 'ds.partial'}: 2 of {meta['units']} units already done" in capsys.readouterr().err
    assert meta["source"] == str(new) and not (tmp_path / "ds.partial").exists()
    clean = prepare(str(new), "bytes", str(tmp_path / "clean"), **kw)
    assert meta == clean
    np.testing.assert_array_equal(stream(out, "train"), stream(tmp_path / "clean", "train"))


def test_max_docs_counts_the_documents_of_the_source(tmp_path):
    source, docs = corpus(tmp_path)
    meta = prepare(source, "bytes", str(tmp_path / "ds"), val_fraction=0.2, max_docs=70, progress=False,
                   unit_bytes=3000)
    want_train, want_val = by_hash(docs[:70], 0.2)
    assert meta["splits"]["train"]["documents"] == len(want_train)
    assert meta["splits"]["val"]["documents"] == len(want_val)  # held-out documents count towards max_docs


def test_hf_max_docs_counts_records(tmp_path):
    datasets = pytest.importorskip("datasets")
    records = [f"record {i}: " + " ".join(WORDS[i % 7 : i % 7 + 6]) for i in range(60)]
    datasets.Dataset.from_dict({"text": records}).save_to_disk(str(tmp_path / "hf"))
    meta = prepare(f"hf:{tmp_path / 'hf'}", "bytes", str(tmp_path / "ds"), val_fraction=0.2, max_docs=40,
                   progress=False)
    want_train, want_val = by_hash(records[:40], 0.2)
    assert (meta["splits"]["train"]["documents"], meta["splits"]["val"]["documents"]) == (len(want_train), len(want_val))


def test_bpe_trains_on_a_capped_sample(tmp_path, monkeypatch):
    source, docs = corpus(tmp_path)
    seen = []
    real = prepare_module.train_bpe

    def recording(texts, vocab_size):
        texts = list(texts)
        seen.extend(texts)
        return real(texts, vocab_size)

    monkeypatch.setattr(prepare_module, "train_bpe", recording)
    monkeypatch.setattr(prepare_module, "BPE_SAMPLE_DOCS", 25)
    prepare(source, "bpe:300", str(tmp_path / "ds"), val_fraction=0.2, progress=False, unit_bytes=3000)
    assert seen == by_hash(docs, 0.2)[0][:25]  # the first training documents, no more


def test_unigram_counts_are_stored(tmp_path):
    source, _ = corpus(tmp_path)
    prepare(source, "bytes", str(tmp_path / "ds"), val_fraction=0.2, progress=False, unit_bytes=3000)
    counts = TokenData(str(tmp_path / "ds")).unigram()
    for s, split in enumerate(("train", "val")):
        np.testing.assert_array_equal(counts[s], np.bincount(stream(tmp_path / "ds", split), minlength=257))


def test_dataset_of_the_earlier_format_still_loads(tmp_path):
    """Format 1 (one flat train.bin / val.bin): read as one shard each; unigram counts computed in chunks."""
    out = tmp_path / "old"
    out.mkdir()
    rng = np.random.default_rng(0)
    splits = {}
    for split, n in (("train", 5000), ("val", 900)):
        tokens = rng.integers(0, 257, n).astype(np.uint16)
        tokens.tofile(out / f"{split}.bin")
        splits[split] = {"tokens": n, "documents": 3, "bytes": n}
    (out / "meta.json").write_text(json.dumps(dict(format=1, source="x", tokenizer="bytes", vocab_size=257,
                                                   eos_id=256, dtype="uint16", splits=splits)))
    data = TokenData(str(out))
    np.testing.assert_array_equal(np.asarray(data.tokens("train")), np.fromfile(out / "train.bin", np.uint16))
    np.testing.assert_array_equal(data.unigram()[1], np.bincount(np.fromfile(out / "val.bin", np.uint16),
                                                                 minlength=257))


def test_prepare_into_and_read_from_a_bucket(fake_bucket, tmp_path):
    source, docs = corpus(tmp_path, n_files=2)
    local = prepare(source, "bytes", str(tmp_path / "local"), val_fraction=0.2, progress=False, unit_bytes=3000)
    remote = prepare(source, "bytes", "gs://data/ds", val_fraction=0.2, progress=False, unit_bytes=3000)
    assert remote == local
    assert os.path.exists(os.path.join(fake_bucket.root, "data", "ds", "meta.json"))
    data = TokenData("gs://data/ds")
    tokens = data.tokens("train")
    np.testing.assert_array_equal(np.asarray(tokens), stream(tmp_path / "local", "train"))
    starts = [0, 1000, len(tokens) - 40]
    np.testing.assert_array_equal(tokens.windows(starts, 33),
                                  np.stack([np.asarray(tokens)[s : s + 33] for s in starts]).astype(np.int32))
    first = source.split(",")[0]  # other input: refused, then replaced (built beside, moved in when complete)
    with pytest.raises(DataError, match="other input.*--overwrite"):
        prepare(first, "bytes", "gs://data/ds", val_fraction=0.2, progress=False, unit_bytes=3000)
    replaced = prepare(first, "bytes", "gs://data/ds", val_fraction=0.2, progress=False, unit_bytes=3000,
                       overwrite=True)
    assert replaced["source"] == first and TokenData("gs://data/ds").meta == replaced
    assert sorted(os.listdir(os.path.join(fake_bucket.root, "data"))) == ["ds"]


@pytest.mark.parametrize("damage", ["binary", "latin1", "empty", "missing_shard", "empty_shard"])
def test_bad_input_is_a_data_error_naming_the_file(tmp_path, damage):
    if damage in ("binary", "latin1", "empty"):
        path = tmp_path / "bad.txt"
        path.write_bytes({"binary": b"\x00\xff\xfe\x00\x80" * 100, "latin1": "caf\xe9\n\nna\xefve".encode("latin1"),
                          "empty": b""}[damage])
        with pytest.raises(DataError, match="bad.txt" if damage != "empty" else "no documents|bad.txt"):
            prepare(str(path), "bytes", str(tmp_path / "ds"), val_fraction=0.2, progress=False)
        assert not (tmp_path / "ds" / "meta.json").exists()
        return
    source, _ = corpus(tmp_path)
    prepare(source, "bytes", str(tmp_path / "ds"), val_fraction=0.2, progress=False, unit_bytes=3000)
    shard = tmp_path / "ds" / "train" / "00001.bin"
    shard.unlink() if damage == "missing_shard" else shard.write_bytes(b"")
    with pytest.raises(DataError, match=r"train/00001.bin is missing or empty"):
        TokenData(str(tmp_path / "ds")).tokens("train")


def test_bucket_that_does_not_exist(fake_bucket):
    with pytest.raises(DataError, match="no meta.json"):
        TokenData("gs://nowhere/ds")


# ----------------------------------------------------------------------------- records: Parquet, JSON Lines, hf:


def write_records(path, texts, row_group_size=None, field="text"):
    """Records of `texts` (None: a null) as Parquet (`row_group_size` rows per row group) or JSON Lines
    (plain, .gz or .zst, by the name), with an id beside the text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(path)
    if path.endswith(".parquet"):
        table = pa.table({"id": list(range(len(texts))), field: pa.array(texts, pa.string())})
        pq.write_table(table, path, row_group_size=row_group_size)
        return
    lines = "".join(json.dumps({"id": i, field: t}) + "\n" for i, t in enumerate(texts)).encode()
    if path.endswith(".zst"):
        with pa.CompressedOutputStream(path, "zstd") as f:
            f.write(lines)
    elif path.endswith(".gz"):
        with gzip.open(path, "wb") as f:
            f.write(lines)
    else:
        with open(path, "wb") as f:
            f.write(lines)


RECORD_KINDS = [".parquet"] * 20 + [".jsonl.zst"] * 16 + [".jsonl.gz", ".json.gz", ".jsonl", ".json"]


def record_corpus(folder, n_files=40):
    """`n_files` small record files of every kind (Parquet ones of several row groups), and the source
    that lists them: (source, every record in source order, empty ones included)."""
    folder.mkdir()
    records = []
    for i, suffix in enumerate(RECORD_KINDS[:n_files]):
        texts = make_docs(12, 100 + i, f"r{i}")
        texts[3], texts[7] = ("", None) if i % 2 else ("  \n ", "")  # empty records: skipped
        write_records(folder / f"r{i:02d}{suffix}", texts, row_group_size=4)
        records.append((suffix, texts))
    order = [".parquet", ".jsonl.zst", ".jsonl.gz", ".json.gz", ".jsonl", ".json"]
    source = ",".join(str(folder / f"*{suffix}") for suffix in order)
    in_order = [t for suffix in order for s, texts in records if s == suffix for t in texts]
    return source, in_order


def expected_bytes(docs, val_fraction):
    train, val = by_hash(docs, val_fraction)
    return {"train": b"".join(d.encode() + b"\xff" for d in train), "val": b"".join(d.encode() + b"\xff" for d in val)}


def stream_bytes(out, split):
    got = stream(out, split)
    return bytes(np.where(got == 256, 255, got).astype(np.uint8))


def test_record_files_are_read_once_whatever_the_workers_and_shards(tmp_path, monkeypatch, capsys):
    """40 Parquet and JSON Lines (.zst, .gz, plain) files, the Parquet ones cut into runs of row groups:
    with 1 or 2 workers, 1 or 2 shards, each record is read exactly once (counted in the reader, in every
    process) and the token stream is the records in source order, empty ones skipped."""
    source, records = record_corpus(tmp_path / "corpus")
    docs = [t for t in records if t and t.strip()]
    kw = dict(val_fraction=0.2, progress=False, unit_bytes=1000)
    want = expected_bytes(docs, 0.2)
    runs = {}
    for name, calls in (("one", [dict()]), ("two", [dict(workers=2)]),
                        ("hosts", [dict(shard=1, num_shards=2), dict(shard=0, num_shards=2)])):
        counts = tmp_path / f"{name}.counts"
        with monkeypatch.context() as patch:
            read_counts.install(str(counts), patch.setattr)
            patch.setenv(read_counts.ENV, str(counts))
            for call in calls:
                capsys.readouterr()
                runs[name] = prepare(source, "bytes", str(tmp_path / name), **kw, **call)
        assert read_counts.read_counts(str(counts)) == Counter(map(read_counts.digest, records)), name
        for split in ("train", "val"):
            assert stream_bytes(tmp_path / name, split) == want[split], (name, split)
    assert runs["one"] == runs["two"] == runs["hosts"]
    assert {p.suffix for split in ("train", "val") for p in (tmp_path / "one" / split).iterdir()} == {".bin"}  # no .idx
    units = json.loads((tmp_path / "one" / "plan.json").read_text())["units"]
    parquet = [u for u in units if u["path"].endswith(".parquet")]
    assert len(units) == runs["one"]["units"] and len(parquet) > 20  # large Parquet files: runs of row groups
    assert [g for u in parquet if u["path"] == parquet[0]["path"] for g in u["row_groups"]] == [0, 2, 2, 3]
    n_shard_1 = len(range(1, len(units), 2))  # the second host found the first's units done
    assert f"resuming {tmp_path / 'hosts'}: {n_shard_1} of {len(units)} units already done" in capsys.readouterr().err

    few = prepare(source, "bytes", str(tmp_path / "few"), max_docs=250, **kw)  # documents, not records
    assert stream_bytes(tmp_path / "few", "train") + stream_bytes(tmp_path / "few", "val") == b"".join(
        expected_bytes(docs[:250], 0.2).values())
    assert few["splits"]["train"]["documents"] + few["splits"]["val"]["documents"] == 250


def test_hf_dataset_is_planned_by_its_files(tmp_path, monkeypatch):
    """`hf:NAME` is read file by file as the dataset lists its data files (here a local folder of the
    Hub's layout, resolved by datasets.load_dataset_builder as a Hub dataset is): one unit per file,
    every record read once, never streamed and skipped through."""
    datasets = pytest.importorskip("datasets")
    hub = tmp_path / "hub"
    (hub / "data").mkdir(parents=True)
    texts = [make_docs(15, 200 + i, f"hf{i}") for i in range(3)]
    for i, part in enumerate(texts):
        write_records(hub / "data" / f"train-{i:05d}-of-00003.parquet", part, field="content")
    write_records(hub / "data" / "test-00000-of-00001.parquet", make_docs(5, 300, "test"), field="content")

    def refused(*args, **kwargs):
        raise AssertionError("an hf: dataset is read by its files, not streamed")

    monkeypatch.setattr(datasets, "load_dataset", refused)
    monkeypatch.setattr(datasets.IterableDataset, "skip", refused)
    counts = tmp_path / "counts"
    read_counts.install(str(counts), monkeypatch.setattr)
    monkeypatch.setenv(read_counts.ENV, str(counts))
    meta = prepare(f"hf:{hub}", "bytes", str(tmp_path / "ds"), val_fraction=0.2, text_field="content",
                   progress=False)
    plan = json.loads((tmp_path / "ds" / "plan.json").read_text())
    assert plan["units"] == [{"path": str(hub / "data" / f"train-{i:05d}-of-00003.parquet"), "row_groups": [0, 1]}
                             for i in range(3)]
    assert read_counts.read_counts(str(counts)) == Counter(read_counts.digest(t) for part in texts for t in part)
    docs = [t for part in texts for t in part]
    assert meta["units"] == 3 and stream_bytes(tmp_path / "ds", "val") == expected_bytes(docs, 0.2)["val"]
    with pytest.raises(DataError, match="no split 'dev'.*train"):
        prepare(f"hf:{hub}", "bytes", str(tmp_path / "ds2"), hf_split="dev", text_field="content", progress=False)


@pytest.mark.parametrize("bad, content, message", [
    ("bad.jsonl", b'{"text": "a"}\n{"body": "b"}\n',
     r"bad.jsonl line 2 has no field 'text' \(--text_field\); its fields: body"),
    ("bad.parquet", None, r"bad.parquet has no field 'text' \(--text_field\); its fields: id, body"),
    ("bad.json", b'{"text": "a"}\n\n{"text": 3}\n', r"bad.json line 3: field 'text' holds 3, not text"),
    ("bad.jsonl.gz", b'{"text": "a"}\n{"text": "b\n', r"bad.jsonl.gz line 2 is not a JSON record"),
    ("bad.jsonl", b'["a", "b"]\n', r"bad.jsonl line 1 is not a JSON object but a list"),
    ("bad.jsonl.zst", b"not zstd" * 20, r"bad.jsonl.zst is named .zst but is not zstd-compressed"),
    ("bad.jsonl.zst", b"\x28\xb5\x2f\xfd" + b"not zstd" * 20, r"bad.jsonl.zst is not a readable zstd file"),
    ("bad.json.gz", b"not gzip" * 20, r"bad.json.gz is named .gz but is not gzip-compressed"),
    ("bad.json.gz", b"\x1f\x8b" + b"not gzip" * 20, r"bad.json.gz is not a readable gzip file"),
    ("bad.parquet", b"PAR1 not parquet" * 20, r"bad.parquet is not a readable Parquet file"),
])
def test_bad_records_are_one_data_error_naming_the_file(tmp_path, bad, content, message):
    good = tmp_path / "good.jsonl"
    write_records(good, make_docs(5, 1, "good"))
    path = tmp_path / bad
    if content is None:
        write_records(path, ["x", "y"], field="body")
    elif bad.endswith(".gz") and content.startswith(b"{"):
        with gzip.open(path, "wb") as f:
            f.write(content)
    else:
        path.write_bytes(content)
    with pytest.raises(DataError, match=message):
        prepare(f"{good},{path}", "bytes", str(tmp_path / "ds"), val_fraction=0.2, progress=False)
    assert not (tmp_path / "ds").exists()


def test_record_files_on_a_bucket(fake_bucket, tmp_path):
    """Parquet (cut into runs of row groups, read by byte ranges) and .jsonl.zst files on a gs:// bucket."""
    folder = tmp_path / "bucket" / "corpus"
    folder.mkdir()
    docs = make_docs(30, 5, "bucket")
    write_records(folder / "a.parquet", docs[:15], row_group_size=4)
    write_records(folder / "b.jsonl.zst", docs[15:])
    prepare("gs://corpus/*.parquet,gs://corpus/b.jsonl.zst", "bytes", str(tmp_path / "ds"), val_fraction=0.2,
            progress=False, unit_bytes=1000)
    units = json.loads((tmp_path / "ds" / "plan.json").read_text())["units"]
    assert [u["path"].startswith("gs://") and u["path"].split("/corpus/")[1] for u in units] == [
        "a.parquet", "a.parquet", "b.jsonl.zst"]
    for split, want in expected_bytes(docs, 0.2).items():
        assert stream_bytes(tmp_path / "ds", split) == want
