"""Formats told by content (issue 48, deltares.data.formats): every accepted format x {its suffix, the suffix
upper-cased, another suffix, compressed by each codec (named so, and not)} is read as what it holds, by
prepare's reader and by eval's and analyze's (JSON syntax never scored as text), or refused in one line
naming the file and the format; Parquet's and Arrow's odd corners; text that is not UTF-8 named by file
and line; documents tokenized as text by every tokenizer spec; records without a place to cut; byte-order
marks. Expectations are the records and documents written here, decoded with plain `bytes`."""

import bz2
import gzip
import io
import json
import lzma
import os
import tarfile
import zipfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizers

from deltares.data import documents, prepare as prepare_module
from deltares.data.dataset import TokenData, data_units, source_tokens
from deltares.data.documents import DataError
from deltares.data.prepare import prepare
from deltares.data.tokenizer import ByteTokenizer
from deltares.generate import read_prompts
from conftest import TINY_HF
from test_inputs import by_eval, by_prepare, inputs_digest

RECORDS = ["first record", 'second, with "quotes", {braces} and [brackets]', None, "", "  ", "third: ünïcödé 🐋"]
KEPT = [r for r in RECORDS if r and r.strip()]  # null, empty and blank records are skipped
TEXT_DOCS = ["the first document\nof two lines", "the second: ünïcödé 🐋", '{"not": "a record"} but text after']


def text_bytes():
    return ("\n\n".join(TEXT_DOCS) + "\n").encode()


def jsonl_bytes():
    return "".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(RECORDS)).encode()


def table(texts=RECORDS):
    return pa.table({"id": list(range(len(texts))), "text": pa.array(texts, pa.string())})


def parquet_bytes(t=None):
    sink = io.BytesIO()
    pq.write_table(table() if t is None else t, sink, row_group_size=2)
    return sink.getvalue()


def arrow_bytes(kind, t=None):
    t = table() if t is None else t
    sink = pa.BufferOutputStream()
    with (pa.ipc.new_file if kind == "file" else pa.ipc.new_stream)(sink, t.schema) as writer:
        for batch in t.to_batches(max_chunksize=2):
            writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


COMPRESS = {"gzip": (gzip.compress, ".gz"), "bzip2": (bz2.compress, ".bz2"), "xz": (lzma.compress, ".xz"),
            "zstd": (lambda data: pa.compress(data, "zstd", asbytes=True), ".zst")}
FORMATS = {  # name: (content, its suffix, another accepted suffix, a wrong suffix, the documents it holds)
    "text": (text_bytes, ".txt", ".md", ".parquet", TEXT_DOCS),
    "JSON Lines": (jsonl_bytes, ".jsonl", ".ndjson", ".txt", KEPT),
    "Parquet": (parquet_bytes, ".parquet", ".PARQUET", ".jsonl", KEPT),
    "Arrow file": (lambda: arrow_bytes("file"), ".arrow", ".feather", ".parquet", KEPT),
    "Arrow stream": (lambda: arrow_bytes("stream"), ".arrow", ".ipc", ".txt", KEPT),
}
WHOLE_FILE_ONLY = ("Parquet", "Arrow file")  # need random access: refused when compressed whole


def zstd_decompress_available():
    return pa.Codec.is_available("zstd")


def variants(name):
    """(how it is named, file name, bytes, the documents or the words of the error)."""
    content, suffix, other, wrong, docs = FORMATS[name]
    data = content()
    out = [("its suffix", f"x{suffix}", data, docs), ("upper-case suffix", f"x{suffix.upper()}", data, docs),
           ("another suffix", f"x{other}", data, docs)]
    if name == "text":
        out.append(("wrong suffix", f"x{wrong}", data, ["x.parquet is named .parquet but is no Parquet file"]))
    else:
        out.append(("wrong suffix", f"x{wrong}", data, docs))
    for codec, (compress, ending) in COMPRESS.items():
        for how, file in ((f"{codec}, named so", f"x{suffix}{ending}"), (f"{codec}, not named so", f"x{suffix}")):
            refused = [f"is a {name} file compressed whole with {codec}", "decompress it"]
            out.append((how, file, compress(data), refused if name in WHOLE_FILE_ONLY else docs))
    return out


@pytest.mark.parametrize("name", FORMATS)
def test_every_format_by_every_name_and_codec_is_read_or_one_error(tmp_path, name):
    for how, file, data, want in variants(name):
        folder = tmp_path / how.replace(" ", "_").replace(",", "")
        folder.mkdir()
        (folder / file).write_bytes(data)
        before = inputs_digest(folder)
        for read in (by_prepare, by_eval):
            if isinstance(want[0], str) and want is not FORMATS[name][4]:
                with pytest.raises(DataError) as err:
                    read(str(folder / file))
                assert str(folder / file) in str(err.value) and all(w in str(err.value) for w in want), (how, err.value)
            else:
                assert read(str(folder / file)) == want, (name, how, read.__name__)
        assert inputs_digest(folder) == before


def test_a_whole_prepare_of_every_format_counts_what_was_written(tmp_path):
    """The full command on one file of each format (and each codec): documents and tokens of meta.json
    against the count of what was written (bytes tokenizer: a token per byte, one end-of-text per document)."""
    files, docs = [], []
    for i, name in enumerate(FORMATS):
        content, suffix, _, _, held = FORMATS[name]
        codec = list(COMPRESS)[i % 4] if name not in WHOLE_FILE_ONLY else None
        data = COMPRESS[codec][0](content()) if codec else content()
        files.append(tmp_path / f"{i}{suffix.upper()}{COMPRESS[codec][1] if codec else ''}")
        files[-1].write_bytes(data)
        docs += held
    meta = prepare(",".join(map(str, files)), "bytes", str(tmp_path / "ds"), val_fraction=0.3, progress=False)
    total = {k: meta["splits"]["train"][k] + meta["splits"]["val"][k] for k in ("documents", "tokens", "bytes")}
    n_bytes = sum(len(d.encode()) for d in docs)
    assert total == {"documents": len(docs), "tokens": n_bytes + len(docs), "bytes": n_bytes + len(docs)}


def test_eval_and_analyze_read_records_by_their_text_field(tmp_path):
    path = tmp_path / "body.jsonl"
    path.write_text("".join(json.dumps({"text": "{not this}", "body": t}) + "\n" for t in KEPT))
    tokens, n_bytes = source_tokens(data_units(str(path), text_field="body"), ByteTokenizer(), "body")
    want = b"".join(t.encode() + b"\xff" for t in KEPT)
    assert bytes(np.where(tokens == 256, 255, tokens).astype(np.uint8)) == want and n_bytes == len(want)
    with pytest.raises(DataError, match="body.jsonl line 1 has no field 'content'"):
        data_units(str(path), text_field="content")
        source_tokens(data_units(str(path), text_field="content"), ByteTokenizer(), "content")


# ----------------------------------------------------------------------------- refused, and odd corners


def tar_gz():
    sink = io.BytesIO()
    with tarfile.open(fileobj=sink, mode="w:gz") as tar:
        info = tarfile.TarInfo("a.txt")
        info.size = len(text_bytes())
        tar.addfile(info, io.BytesIO(text_bytes()))
    return sink.getvalue()


def zip_bytes():
    sink = io.BytesIO()
    with zipfile.ZipFile(sink, "w") as z:
        z.writestr("a.txt", text_bytes())
    return sink.getvalue()


def duplicate_columns():
    t = pa.Table.from_arrays([pa.array(["a", "b"]), pa.array(["c", "d"])], names=["text", "text"])
    return parquet_bytes(t)


REFUSED = [  # (file name, bytes, words of the one line)
    ("corpus.zip", zip_bytes(), "is a zip archive, which is not read"),
    ("corpus.txt", zip_bytes(), "is a zip archive, which is not read"),
    ("corpus.tar.gz", tar_gz(), "is gzip-compressed and holds a tar archive"),
    ("corpus.txt.lz4", b"\x04\x22\x4d\x18" + b"\x00" * 40, "is lz4-compressed, which is not read"),
    ("corpus.txt.br", b"\x8b\x02\x80hello\x03", "is brotli-compressed, which is not read"),
    ("utf16.txt", "text\n".encode("utf-16"), "is UTF-16 text, which is not read"),
    ("plain.txt.gz", b"plain text\n", "is named .gz but is not gzip-compressed"),
    ("page.parquet", b"<!DOCTYPE html><html>Not Found</html>", "is named .parquet but is no Parquet file"),
    ("latin1.txt.gz", gzip.compress("caf\xe9\n\nna\xefve\n".encode("latin-1")), "line 1 is not UTF-8 text (byte 3"),
    ("surrogate.txt", b"fine\n\nbad \xed\xa0\x80 here\n", "line 3 is not UTF-8 text (byte 10: a lone surrogate"),
    ("surrogate.jsonl", b'{"text": "fine"}\n{"text": "bad \\ud800 here"}\n',
     "line 2: field 'text' holds a lone surrogate (\\ud800)"),
    ("raw_surrogate.jsonl", b'{"text": "fine"}\n{"text": "bad \xed\xa0\x80 here"}\n', "line 2 is not UTF-8 text"),
    ("BROKEN.JSONL", b'{"text": "a"\n{"text": "b"}\n', "line 1 is not a JSON record"),
    ("duplicate.parquet", duplicate_columns(), "has 2 columns named 'text' (--text_field)"),
    ("numbers.arrow", arrow_bytes("file", pa.table({"text": [1, 2]})), "field 'text' holds int64, not text"),
]


@pytest.mark.parametrize("file, data, words", REFUSED, ids=[r[0] for r in REFUSED])
def test_what_is_not_read_is_one_error_naming_the_file(tmp_path, file, data, words):
    (tmp_path / file).write_bytes(data)
    for read in (by_prepare, by_eval):
        with pytest.raises(DataError) as err:
            read(str(tmp_path / file))
        assert str(err.value).startswith(str(tmp_path / file)) and words in str(err.value), err.value
        assert "\n" not in str(err.value)


def test_dictionary_encoded_text_and_null_rows_are_read(tmp_path):
    encoded = pa.table({"text": pa.array(RECORDS, pa.string()).dictionary_encode()})
    assert pa.types.is_dictionary(encoded.schema.field("text").type)
    (tmp_path / "dict.parquet").write_bytes(parquet_bytes(encoded))
    (tmp_path / "dict.arrow").write_bytes(arrow_bytes("file", encoded))
    pq.write_table(encoded, tmp_path / "read_dict.parquet")
    assert pq.read_table(tmp_path / "read_dict.parquet", read_dictionary=["text"]).schema.field("text").type == (
        encoded.schema.field("text").type)
    for file in ("dict.parquet", "dict.arrow", "read_dict.parquet"):
        for read in (by_prepare, by_eval):
            assert read(str(tmp_path / file)) == KEPT, (file, read.__name__)


# ----------------------------------------------------------------------------- text is text

SPECIAL = ["a document that says <|endoftext|> in the middle", "<|im_start|>user and <think> then </s>",
           "<|endoftext|>", "ends with <|endoftext|><|endoftext|>", "plain words, nothing special at all"]


def tokenizer_with_added_tokens(folder):
    """A byte-level BPE whose end-of-text and `<think>` are added tokens that are *not* special (the kind
    that `encode_special_tokens` alone would still match in text)."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(["some words to learn merges from"] * 10, trainer=trainer)
    tok.add_tokens(["<|endoftext|>", "<think>"])
    tok.save(str(folder / "tokenizer.json"))
    return f"hf:{folder / 'tokenizer.json'}"


@pytest.mark.parametrize("spec", ["bytes", "gpt2", "hf:qwen3", "hf:not-special", "bpe:300"])
def test_special_strings_in_documents_are_text(tmp_path, spec):
    """Every tokenizer spec: exactly one end-of-text per document (counted in the token files), each document
    decoding to itself, in prepare's data and in eval's tokens."""
    spec = {"hf:qwen3": f"hf:{TINY_HF}", "hf:not-special": None}.get(spec, spec) or tokenizer_with_added_tokens(tmp_path)
    docs = SPECIAL * 8 + [f"filler document number {i} for the trainer" for i in range(40)]
    docs = [f"{d} #{i}" for i, d in enumerate(docs)]  # distinct, so the split hashes them apart
    (tmp_path / "special.txt").write_text("\n\n".join(docs) + "\n")
    meta = prepare(str(tmp_path / "special.txt"), spec, str(tmp_path / "ds"), val_fraction=0.3, progress=False)
    data = TokenData(str(tmp_path / "ds"))
    tokenizer, eos = data.tokenizer(), meta["eos_id"]
    got = []
    for split in ("train", "val"):
        tokens = np.asarray(data.tokens(split))
        assert tokens[-1] == eos and np.count_nonzero(tokens == eos) == meta["splits"][split]["documents"]
        got += [tokenizer.decode(d[:-1]) for d in np.split(tokens, np.flatnonzero(tokens == eos) + 1)[:-1]]
    assert sorted(got) == sorted(docs)
    tokens, _ = source_tokens(data_units(str(tmp_path / "special.txt")), tokenizer)
    assert np.count_nonzero(tokens == eos) == len(docs) and tokens[-1] == eos


# ----------------------------------------------------------------------------- records of any size


def test_a_record_without_a_place_to_cut_is_cut_before_it_is_tokenized(tmp_path, monkeypatch):
    """A record and a line of 3 MB without a space reach the tokenizer in pieces of at most twice
    PIECE_BYTES, and the documents are whole."""
    huge = "x" * (3 << 20)
    (tmp_path / "huge.jsonl").write_text(json.dumps({"text": "small"}) + "\n" + json.dumps({"text": huge}) + "\n")
    (tmp_path / "huge.txt").write_text("before\n\n" + huge + "\n\nafter\n")
    longest = []
    real = prepare_module.encode_texts
    monkeypatch.setattr(prepare_module, "encode_texts",
                        lambda texts, tok: (longest.append(max(map(len, texts), default=0)), real(texts, tok))[1])
    meta = prepare(f"{tmp_path / 'huge.jsonl'},{tmp_path / 'huge.txt'}", "bytes", str(tmp_path / "ds"),
                   val_fraction=0.4, progress=False)
    assert max(longest) <= 2 * documents.PIECE_BYTES
    docs = ["small", huge, "before", huge, "after"]
    total = {k: meta["splits"]["train"][k] + meta["splits"]["val"][k] for k in ("documents", "tokens")}
    assert total == {"documents": 5, "tokens": sum(len(d) + 1 for d in docs)}


def test_pieces_cut_without_a_place_to_cut_decode_to_the_whole(monkeypatch):
    monkeypatch.setattr(documents, "PIECE_BYTES", 4096)
    from deltares.data.tokenizer import load_tokenizer

    gpt2 = load_tokenizer("gpt2")
    text = "unbroken" * 5000 + " then words follow the long run"
    pieces = documents._cut(text)
    assert len(pieces) > 5 and max(map(len, pieces)) <= 2 * 4096 and "".join(pieces) == text
    assert gpt2.decode([t for p in pieces for t in gpt2.encode(p)]) == text  # byte-level: nothing lost at a cut


# ----------------------------------------------------------------------------- byte-order marks


def test_a_byte_order_mark_is_no_part_of_a_prompt_or_a_document(tmp_path):
    bom = b"\xef\xbb\xbf"
    (tmp_path / "p.txt").write_bytes(bom + b"Call me Ishmael.\nThe whale\n")
    (tmp_path / "p.jsonl").write_bytes(bom + b'"Call me\\nIshmael."\n{"prompt": "The whale"}\n')
    (tmp_path / "p.txt.gz").write_bytes(gzip.compress(bom + b"Call me Ishmael.\n"))
    assert read_prompts(str(tmp_path / "p.txt")) == ["Call me Ishmael.", "The whale"]
    assert read_prompts(str(tmp_path / "p.jsonl")) == ["Call me\nIshmael.", "The whale"]
    assert read_prompts(str(tmp_path / "p.txt.gz")) == ["Call me Ishmael."]
    (tmp_path / "d.txt").write_bytes(bom + b"first\n\nsecond\n")
    (tmp_path / "d.jsonl").write_bytes(bom + b'{"text": "first"}\n{"text": "second"}\n')
    for file in ("d.txt", "d.jsonl"):
        for read in (by_prepare, by_eval):
            assert read(str(tmp_path / file)) == ["first", "second"], (file, read.__name__)


def test_prompt_files_that_are_no_prompts_are_one_error(tmp_path):
    (tmp_path / "p.parquet").write_bytes(parquet_bytes())
    (tmp_path / "bad.jsonl").write_bytes(b'"fine"\n"bad \\udc80"\n')
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    for file, words in (("p.parquet", "is a Parquet file; prompts are read from text or JSON Lines files"),
                        ("bad.jsonl", "bad.jsonl line 2: the prompt holds a lone surrogate"),
                        ("latin1.txt", "latin1.txt line 1 is not UTF-8 text (byte 3")):
        with pytest.raises(DataError, match=words.replace("(", r"\(")):
            read_prompts(str(tmp_path / file))
    assert os.listdir(tmp_path)  # nothing removed
