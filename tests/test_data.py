"""Data preparation (`deltares.data.prepare`) and the grain input pipeline (`deltares.data.dataset`).

Expectations are written here independently of the code under test: documents are
split by hand, token streams are decoded with plain `bytes`, GPT-2 ids are known
constants, and window identities come from a synthetic `arange` token array (the
window starting at token `i * seq_len` begins with the value `i * seq_len`).
"""

import gzip
import hashlib
import json
import re

import numpy as np
import pytest
import tokenizers

from deltares.data.dataset import TokenData, Windows, eval_batches, train_dataset, train_iterator
from deltares.data.documents import DataError, source_units, unit_pieces
from deltares.data.prepare import prepare

# ----------------------------------------------------------------------------- helpers

WORDS = (
    "whale ship sea captain harpoon deck mast sail wind wave storm ocean voyage crew sailor "
    "boat oil white hunt island harbour rope anchor compass chart night morning fog ice"
).split()


def make_docs(n, seed, tag):
    """`n` distinct paragraphs (multi-line, some non-ASCII) tagged so each is unique."""
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        lines = []
        for _ in range(int(rng.integers(1, 4))):
            lines.append(" ".join(rng.choice(WORDS, size=int(rng.integers(4, 12)))))
        lines[0] = f"{tag} doc {i}: café naïve — {lines[0]}"
        docs.append("\n".join(lines))
    return docs


def write_corpus(path, docs, seps=None):
    """Documents separated by blank lines (some with whitespace on the blank line), with padding."""
    seps = seps or ["\n\n", "\n   \n", "\n\n\n", "\n\t\n"]
    text = "\n\n"  # leading blank lines must not create an empty document
    for i, doc in enumerate(docs):
        text += doc + (seps[i % len(seps)] if i < len(docs) - 1 else "\n")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def read_bin(out_dir, split, dtype):
    tokens = np.asarray(TokenData(str(out_dir)).tokens(split))
    assert tokens.dtype == dtype
    return tokens


def held(doc, val_fraction):
    """The validation split's rule, written out: blake2b-64 of the document's first 64 KiB of UTF-8,
    little-endian, modulo a million, below val_fraction in millionths."""
    digest = hashlib.blake2b(doc.encode("utf-8")[: 1 << 16], digest_size=8).digest()
    return int.from_bytes(digest, "little") % 1_000_000 < round(val_fraction * 1_000_000)


def by_hash(docs, val_fraction):
    return [d for d in docs if not held(d, val_fraction)], [d for d in docs if held(d, val_fraction)]


def split_stats(meta_split):
    return {k: v for k, v in meta_split.items() if k != "shards"}


def split_at_eos(tokens, eos):
    """Token lists of the documents of a flat stream in which every document ends with `eos`."""
    tokens = [int(t) for t in tokens]
    assert tokens and tokens[-1] == eos, "the stream must end with end-of-text"
    docs, cur = [], []
    for t in tokens:
        if t == eos:
            docs.append(cur)
            cur = []
        else:
            cur.append(t)
    return docs


def byte_docs(out_dir, split):
    return [bytes(d).decode("utf-8") for d in split_at_eos(read_bin(out_dir, split, np.uint16), 256)]


def expected_split_stats(docs):
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    return dict(documents=len(docs), tokens=n_bytes + len(docs), bytes=n_bytes + len(docs))


def read_documents(source):
    """The documents of a source as prepare (and eval) read them: its units' pieces, joined."""
    docs, parts = [], []
    for unit in source_units(source):
        for piece in unit_pieces(unit, 0.0, "text"):
            parts.append(piece.text)
            if piece.last:
                docs.append("".join(parts))
                parts = []
    return docs


# ----------------------------------------------------------------------------- prepare: text files


def test_documents_are_split_on_blank_lines(tmp_path):
    (tmp_path / "a.txt").write_text("\n\nfirst line\nsecond line\n\n  \n\nthird\n \t \nfourth\n\n")
    assert read_documents(str(tmp_path / "a.txt")) == ["first line\nsecond line", "third", "fourth"]


def test_read_text_plain_gzip_and_byte_order_mark(tmp_path):
    text = "caf\u00e9 \u2014 na\u00efve\n\nsecond \U0001f40b\n"
    (tmp_path / "a.txt").write_bytes(text.encode("utf-8"))
    (tmp_path / "b.txt.gz").write_bytes(gzip.compress(text.encode("utf-8")))
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    for name in ("a.txt", "b.txt.gz", "bom.txt"):
        assert read_documents(str(tmp_path / name)) == [d.strip() for d in text.split("\n\n")], name


def test_read_documents_of_globs_and_lists_in_order(tmp_path):
    write_corpus(tmp_path / "2.txt", make_docs(3, 5, "two"))
    with gzip.open(tmp_path / "1.txt.gz", "wt", encoding="utf-8") as f:
        f.write("\n\n".join(make_docs(2, 6, "one")))
    one, two = make_docs(2, 6, "one"), make_docs(3, 5, "two")
    assert read_documents(str(tmp_path / "*")) == one + two  # sorted file names
    assert read_documents(f"{tmp_path / '2.txt'}, {tmp_path / '1.txt.gz'}") == two + one  # as listed


@pytest.mark.parametrize(
    "name, data",
    [
        pytest.param("latin1.txt", "caf\u00e9\n\nna\u00efve\n".encode("latin-1"), id="latin-1"),
        pytest.param("latin1.txt.gz", gzip.compress("caf\u00e9\n".encode("latin-1")), id="latin-1-gzipped"),
        pytest.param("blob.txt", bytes(range(256)) * 4, id="binary"),
        pytest.param("text.txt.gz", b"plain text, not gzip\n", id="not-gzip"),
    ],
)
def test_undecodable_input_is_a_data_error_naming_the_file(tmp_path, name, data):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(DataError, match=re.escape(str(path))):
        read_documents(str(path))
    out = tmp_path / "out"
    with pytest.raises(DataError, match=re.escape(str(path))):
        prepare(str(path), "bytes", str(out), val_fraction=0.25, progress=False)
    assert not out.exists()


def test_prepare_text_files_splits_whole_documents(tmp_path):
    docs_a, docs_b = make_docs(8, 1, "A"), make_docs(12, 2, "B")
    write_corpus(tmp_path / "a.txt", docs_a)
    with gzip.open(tmp_path / "b.txt.gz", "wt", encoding="utf-8") as f:  # .gz is read transparently
        f.write("\n\n".join(docs_b) + "\n")
    out = tmp_path / "ds"
    meta = prepare(f"{tmp_path}/a.txt,{tmp_path}/b.txt.gz", "bytes", str(out), val_fraction=0.25, progress=False)

    # val: the documents the hash holds out, whichever file; train: the rest; file and document order kept
    want_train, want_val = by_hash(docs_a + docs_b, 0.25)
    assert want_val and want_train
    got_train, got_val = byte_docs(out, "train"), byte_docs(out, "val")
    assert sorted(got_train) == sorted(want_train)
    assert sorted(got_val) == sorted(want_val)
    assert not set(got_train) & set(got_val)
    assert got_train == want_train and got_val == want_val  # file order, document order kept

    on_disk = json.loads((out / "meta.json").read_text())
    assert on_disk == meta
    assert meta["tokenizer"] == "bytes" and meta["vocab_size"] == 257 and meta["eos_id"] == 256
    assert meta["dtype"] == "uint16"
    assert split_stats(meta["splits"]["train"]) == expected_split_stats(want_train)
    assert split_stats(meta["splits"]["val"]) == expected_split_stats(want_val)
    assert not (out / "tokenizer.json").exists()  # bytes needs none

    data = TokenData(str(out))
    assert data.tokens("train").dtype == np.uint16 and len(data.tokens("train")) == meta["splits"]["train"]["tokens"]
    tok = data.tokenizer()
    assert tok.decode(data.tokens("val")) == "".join(want_val)  # eos (256) is dropped by decode


def test_prepare_glob_and_single_document_file(tmp_path):
    """A glob picks files in sorted order; a corpus of one document per file has a validation split."""
    (tmp_path / "c").mkdir()
    write_corpus(tmp_path / "c" / "2.txt", make_docs(4, 3, "two"))
    write_corpus(tmp_path / "c" / "1.txt", make_docs(4, 4, "one"))
    write_corpus(tmp_path / "c" / "3.txt", ["lonely single document"])
    out = tmp_path / "ds"
    prepare(str(tmp_path / "c" / "*.txt"), "bytes", str(out), val_fraction=0.25, progress=False)
    want_train, want_val = by_hash(make_docs(4, 4, "one") + make_docs(4, 3, "two") + ["lonely single document"], 0.25)
    assert byte_docs(out, "train") == want_train and byte_docs(out, "val") == want_val

    singles = make_docs(40, 9, "single")
    (tmp_path / "d").mkdir()
    for i, doc in enumerate(singles):
        write_corpus(tmp_path / "d" / f"{i:02d}.txt", [doc])
    prepare(str(tmp_path / "d" / "*.txt"), "bytes", str(tmp_path / "ds1"), val_fraction=0.2, progress=False)
    want_train, want_val = by_hash(singles, 0.2)
    assert byte_docs(tmp_path / "ds1", "val") == want_val and len(want_val) >= 2
    assert byte_docs(tmp_path / "ds1", "train") == want_train


@pytest.mark.parametrize(
    "make_source",
    [
        pytest.param(lambda d: str(d / "empty.txt"), id="empty-file"),
        pytest.param(lambda d: str(d / "blank.txt"), id="only-blank-lines"),
        pytest.param(lambda d: str(d / "nope.txt"), id="missing-file"),
        pytest.param(lambda d: str(d / "nothing-*.txt"), id="glob-without-match"),
        pytest.param(lambda d: str(d), id="directory"),
    ],
)
def test_prepare_bad_sources_raise_data_error_and_write_nothing(tmp_path, make_source):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("\n\n   \n\n")
    out = tmp_path / "out"
    with pytest.raises(DataError):
        prepare(make_source(tmp_path), "bytes", str(out), val_fraction=0.1, progress=False)
    assert not out.exists()


def test_prepare_bad_val_fraction_and_tokenizer(tmp_path):
    write_corpus(tmp_path / "a.txt", make_docs(4, 0, "x"))
    for frac in (0.0, 0.5, 1.0, -0.1):
        with pytest.raises(DataError, match="val_fraction"):
            prepare(str(tmp_path / "a.txt"), "bytes", str(tmp_path / "o"), val_fraction=frac, progress=False)
    with pytest.raises(ValueError, match="unknown tokenizer"):
        prepare(str(tmp_path / "a.txt"), "nonsense", str(tmp_path / "o"), val_fraction=0.25, progress=False)
    with pytest.raises(ValueError, match="300"):
        prepare(str(tmp_path / "a.txt"), "bpe:100", str(tmp_path / "o"), val_fraction=0.25, progress=False)


def test_prepare_refuses_other_input_into_a_dataset_and_replaces_it_on_request(tmp_path):
    write_corpus(tmp_path / "a.txt", make_docs(20, 0, "old"))
    write_corpus(tmp_path / "b.txt", make_docs(20, 1, "new"))
    out = tmp_path / "ds"
    first = prepare(str(tmp_path / "a.txt"), "bytes", str(out), val_fraction=0.25, progress=False)
    assert prepare(str(tmp_path / "a.txt"), "bytes", str(out), val_fraction=0.25, progress=False) == first
    with pytest.raises(DataError, match=r"prepared from other input \(differs in source, units\).*--overwrite"):
        prepare(str(tmp_path / "b.txt"), "bytes", str(out), val_fraction=0.25, progress=False)
    assert byte_docs(out, "train") == by_hash(make_docs(20, 0, "old"), 0.25)[0]  # untouched
    prepare(str(tmp_path / "b.txt"), "bytes", str(out), val_fraction=0.25, progress=False, overwrite=True)
    assert byte_docs(out, "train") == by_hash(make_docs(20, 1, "new"), 0.25)[0]


def test_token_data_rejects_unprepared_dirs(tmp_path):
    with pytest.raises(DataError, match="meta.json"):
        TokenData(str(tmp_path))
    (tmp_path / "meta.json").write_text(json.dumps({"format": 999}))
    with pytest.raises(DataError, match="format"):
        TokenData(str(tmp_path))


# ----------------------------------------------------------------------------- tokenizers


def test_bpe_tokenizer_trained_and_cached(tmp_path):
    docs = make_docs(60, 5, "bpe")
    write_corpus(tmp_path / "a.txt", docs)
    out = tmp_path / "ds"
    meta = prepare(str(tmp_path / "a.txt"), "bpe:320", str(out), val_fraction=0.1, progress=False)
    assert meta["tokenizer"] == "bpe:320" and meta["vocab_size"] == 320 and meta["dtype"] == "uint16"

    # the trained tokenizer is stored beside the data and is what a reader gets back
    assert (out / "tokenizer.json").exists()
    stored = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    assert stored.get_vocab_size(with_added_tokens=True) == 320
    eos = stored.token_to_id("<|endoftext|>")
    assert eos == meta["eos_id"]

    train_ids = read_bin(out, "train", np.uint16)
    assert int(train_ids.max()) < 320
    want_train, _ = by_hash(docs, 0.1)
    got_docs = split_at_eos(train_ids, eos)
    assert len(got_docs) == len(want_train)
    for ids, doc in zip(got_docs, want_train):
        assert stored.decode(ids) == doc  # byte-level BPE round-trips exactly
        assert stored.encode(doc, add_special_tokens=False).ids == ids  # ids are the stored tokenizer's
    # it actually merges: fewer tokens than bytes
    assert len(train_ids) < meta["splits"]["train"]["bytes"] * 0.8

    # TokenData restores the same tokenizer from tokenizer.json (not by retraining)
    tok = TokenData(str(out)).tokenizer()
    assert tok.vocab_size == 320 and tok.eos_id == eos
    assert tok.encode(want_train[0]) == got_docs[0]


def test_gpt2_tokenizer_round_trip(tmp_path):
    docs = ["Hello world", "The quick brown fox\njumps over the lazy dog.", "Ünïcödé — 日本語 🐋", "last one"]
    write_corpus(tmp_path / "a.txt", docs)
    out = tmp_path / "ds"
    meta = prepare(str(tmp_path / "a.txt"), "gpt2", str(out), val_fraction=0.25, progress=False)
    assert meta["vocab_size"] == 50257 and meta["eos_id"] == 50256 and meta["dtype"] == "uint16"
    train = read_bin(out, "train", np.uint16)
    assert [int(t) for t in train[:3]] == [15496, 995, 50256]  # GPT-2 ids of "Hello", " world", <|endoftext|>
    tok = TokenData(str(out)).tokenizer()
    want_train, want_val = by_hash(docs, 0.25)
    assert want_train == [docs[0], docs[2]] and want_val == [docs[1], docs[3]]  # the hash's choice, as written
    decoded = [tok.decode(d) for d in split_at_eos(train, 50256)]
    assert decoded == want_train
    assert [tok.decode(d) for d in split_at_eos(read_bin(out, "val", np.uint16), 50256)] == want_val
    assert meta["splits"]["train"]["bytes"] == sum(len(d.encode()) + 1 for d in want_train)


# ----------------------------------------------------------------------------- prepare: Hugging Face datasets


@pytest.fixture(scope="module")
def hf_records():
    return [f"record {i}: " + " ".join(WORDS[i % len(WORDS) : i % len(WORDS) + 5]) + " ÿ" for i in range(20)]


@pytest.mark.parametrize("layout", ["parquet", "save_to_disk"])
def test_prepare_local_hf_dataset(tmp_path, hf_records, layout):
    datasets = pytest.importorskip("datasets")
    src = tmp_path / "hf"
    table = datasets.Dataset.from_dict({"text": hf_records, "id": list(range(len(hf_records)))})
    if layout == "parquet":
        (src / "data").mkdir(parents=True)
        table.to_parquet(str(src / "data" / "train-00000.parquet"))
    else:
        table.save_to_disk(str(src))
    out = tmp_path / "ds"
    meta = prepare(f"hf:{src}", "bytes", str(out), val_fraction=0.25, progress=False)
    # the records the hash holds out, as for text
    want_train, want_val = by_hash(hf_records, 0.25)
    assert byte_docs(out, "train") == want_train
    assert byte_docs(out, "val") == want_val
    assert split_stats(meta["splits"]["train"]) == expected_split_stats(want_train)
    assert split_stats(meta["splits"]["val"]) == expected_split_stats(want_val)
    assert meta["source"] == f"hf:{src}"

    with pytest.raises(DataError, match="body"):
        prepare(f"hf:{src}", "bytes", str(tmp_path / "ds2"), val_fraction=0.25, text_field="body", progress=False)


# ----------------------------------------------------------------------------- grain pipeline

N_TOKENS, SEQ, BATCH = 32 * 40 + 1, 32, 4  # exactly 40 windows
N_WINDOWS = 40


def arange_tokens(n=N_TOKENS):
    return np.arange(n, dtype=np.int64) % 60000  # values == positions (< n here)


def window_ids(batch):
    """Identity of each window of a [B, T+1] batch from the arange tokens: its start / seq_len."""
    batch = np.asarray(batch)
    assert batch.dtype == np.int32
    assert batch.shape[1] == SEQ + 1
    starts = batch[:, 0]
    assert (starts % SEQ == 0).all()
    # every window is contiguous: seq_len + 1 consecutive tokens
    np.testing.assert_array_equal(batch, starts[:, None] + np.arange(SEQ + 1)[None, :])
    return [int(s) // SEQ for s in starts]


def first_batches(ds, n):
    return [np.asarray(ds[i]) for i in range(n)]


def test_windows_cover_the_stream():
    w = Windows(arange_tokens(), SEQ)
    assert len(w) == N_WINDOWS
    np.testing.assert_array_equal(w[N_WINDOWS - 1], np.arange((N_WINDOWS - 1) * SEQ, N_WINDOWS * SEQ + 1))
    # one token short of the last window's target: one window fewer
    assert len(Windows(arange_tokens(N_TOKENS - 1), SEQ)) == N_WINDOWS - 1


def test_train_batches_deterministic_per_seed():
    a = first_batches(train_dataset(arange_tokens(), SEQ, BATCH, seed=7), 12)
    b = first_batches(train_dataset(arange_tokens(), SEQ, BATCH, seed=7), 12)
    c = first_batches(train_dataset(arange_tokens(), SEQ, BATCH, seed=8), 12)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert [window_ids(x) for x in a] != [window_ids(x) for x in c]
    assert all(x.shape == (BATCH, SEQ + 1) for x in a)
    # shuffled: not simply the windows in order
    assert sum((window_ids(x) for x in a[:10]), []) != list(range(N_WINDOWS))


def test_every_window_once_per_epoch_and_epochs_reshuffled():
    ds = train_dataset(arange_tokens(), SEQ, BATCH, seed=3)
    per_epoch = N_WINDOWS // BATCH  # 40 windows = 10 full batches per epoch
    ids = sum((window_ids(b) for b in first_batches(ds, 3 * per_epoch)), [])
    epochs = [ids[e * N_WINDOWS : (e + 1) * N_WINDOWS] for e in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(N_WINDOWS))
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]


def test_every_window_once_per_epoch_with_remainder():
    """42 windows with a batch of 4: epochs straddle batches, yet each epoch is a permutation."""
    tokens = arange_tokens(32 * 42 + 1)
    ids = sum((window_ids(b) for b in first_batches(train_dataset(tokens, SEQ, BATCH, seed=0), 21)), [])
    assert sorted(ids[:42]) == list(range(42)) and sorted(ids[42:84]) == list(range(42))


def test_process_shards_split_the_global_batch():
    global_ds = train_dataset(arange_tokens(), SEQ, BATCH, seed=11)
    shards = [train_dataset(arange_tokens(), SEQ, BATCH, seed=11, process_index=p, process_count=2) for p in (0, 1)]
    for step in range(15):
        want = window_ids(global_ds[step])
        parts = [window_ids(s[step]) for s in shards]
        assert all(len(p) == BATCH // 2 for p in parts)
        assert not set(parts[0]) & set(parts[1])
        assert sorted(parts[0] + parts[1]) == sorted(want)
    with pytest.raises(DataError, match="divisible"):
        train_dataset(arange_tokens(), SEQ, 3, seed=0, process_index=0, process_count=2)


def test_train_dataset_too_small_for_a_batch():
    with pytest.raises(DataError, match="fewer than one batch"):
        train_dataset(arange_tokens(SEQ * 3 + 1), SEQ, BATCH, seed=0)


def test_iterator_state_restore_continues_identically():
    ds = train_dataset(arange_tokens(), SEQ, BATCH, seed=5)
    it = train_iterator(ds, prefetch=2)
    head = [np.asarray(next(it)) for _ in range(13)]  # past an epoch boundary (10 batches)
    state = it.get_state()
    saved = json.loads(json.dumps(state))  # checkpoints store it as JSON
    tail = [np.asarray(next(it)) for _ in range(9)]

    # the iterator yields exactly the dataset's batches in order
    for i, b in enumerate(head + tail):
        np.testing.assert_array_equal(b, np.asarray(ds[i]))

    fresh = train_iterator(train_dataset(arange_tokens(), SEQ, BATCH, seed=5), prefetch=2)
    fresh.set_state(saved)
    for want in tail:
        np.testing.assert_array_equal(np.asarray(next(fresh)), want)


def test_validation_batches_fixed_and_in_order():
    tokens = arange_tokens(32 * 11 + 5)  # 11 windows
    got = eval_batches(tokens, SEQ, 3)
    assert len(got) == 3  # 11 // 3 full batches
    for b, batch in enumerate(got):
        for i in range(3):
            start = (b * 3 + i) * SEQ
            np.testing.assert_array_equal(batch[i], np.arange(start, start + SEQ + 1))
    again = eval_batches(tokens, SEQ, 3)
    for x, y in zip(got, again):
        np.testing.assert_array_equal(x, y)
    # fewer batches than the split holds: windows spread evenly over it, not its first ones only
    spread = eval_batches(tokens, SEQ, 3, max_batches=1)
    assert len(spread) == 1 and window_ids(spread[0]) == [0, 3, 7]  # windows i * 11 // 3
    assert len(eval_batches(tokens, SEQ, 3, max_batches=2)) == 2
    with pytest.raises(DataError, match="fewer than one evaluation batch"):
        eval_batches(arange_tokens(2 * SEQ + 1), SEQ, 3)


def test_token_data_reads_prepared_splits(tmp_path):
    docs = make_docs(10, 9, "td")
    write_corpus(tmp_path / "a.txt", docs)
    out = tmp_path / "ds"
    meta = prepare(str(tmp_path / "a.txt"), "bytes", str(out), val_fraction=0.2, progress=False)
    data = TokenData(str(out))
    want = b"".join(d.encode() + b"\xff" for d in by_hash(docs, 0.2)[0])  # 0xff stands in for eos (256)
    got = np.where(np.asarray(data.tokens("train")) == 256, 255, np.asarray(data.tokens("train")))
    assert bytes(got.astype(np.uint8)) == want
    assert data.bytes_per_token("val") == pytest.approx(meta["splits"]["val"]["bytes"] / meta["splits"]["val"]["tokens"])
    (out / "val" / "00000.bin").write_bytes(b"")
    with pytest.raises(DataError, match="empty"):
        TokenData(str(out)).tokens("val")
