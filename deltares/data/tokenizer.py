"""Tokenizers that need no network, named by a spec string.

- `bytes`: UTF-8 bytes 0..255 and end-of-text 256 (vocabulary 257), for tests;
- `gpt2`: the GPT-2 byte-level BPE shipped with deltares (vocabulary 50257);
- `hf:PATH`: a Hugging Face `tokenizer.json`, or a model directory holding one
  (the Qwen3 tokenizer loads this way);
- `bpe:N`: a byte-level BPE of vocabulary N, trained on a corpus's training
  split by `train_bpe` and stored beside the prepared data.

Every tokenizer serialises to JSON (`to_json`) so a prepared dataset records
exactly the tokenizer that made it.

Documents are text: `encode_texts` (what prepare, eval and analyze encode with) reads the strings of
the tokenizer's added tokens (`<|endoftext|>`, `<|im_start|>`, ...) in a document as the ordinary text
they spell, so end-of-text comes only where a document ends. `encode` (prompts) keeps them special.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
from collections.abc import Iterable
from importlib import resources

import tokenizers

EOS_NAMES = ("<|endoftext|>", "<|im_end|>", "</s>", "<eos>")
_ASSETS = resources.files("deltares.data") / "assets"


class ByteTokenizer:
    """UTF-8 bytes; id 256 is end-of-text."""

    spec = "bytes"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def to_json(self) -> str | None:
        return None


class HFTokenizer:
    """A `tokenizers.Tokenizer` with its end-of-text id."""

    def __init__(self, tok: tokenizers.Tokenizer, spec: str):
        self.tok = tok
        self.spec = spec
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        ids = [tok.token_to_id(name) for name in EOS_NAMES]
        ids = [i for i in ids if i is not None]
        if not ids:
            raise ValueError(f"tokenizer {spec!r} has none of the end-of-text tokens {EOS_NAMES}")
        self.eos_id = ids[0]

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch_fast(texts, add_special_tokens=False)]

    @functools.cached_property
    def _as_text(self) -> tokenizers.Tokenizer:
        """A copy that reads the strings of every added token as the text they spell (each marked special,
        and special tokens encoded as text); the tokenizer itself when it has none (GPT-2's)."""
        if not self.tok.get_added_tokens_decoder():
            return self.tok
        data = json.loads(self.tok.to_str())
        for token in data.get("added_tokens") or []:
            token["special"] = True
        tok = tokenizers.Tokenizer.from_str(json.dumps(data))
        tok.encode_special_tokens = True
        return tok

    def encode_text_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, the strings of added tokens in it read as ordinary text."""
        return [e.ids for e in self._as_text.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def to_json(self) -> str:
        return self.tok.to_str()


def encode_texts(texts: list[str], tokenizer) -> list[list[int]]:
    """Token ids of each text of documents, batched where the tokenizer can: the strings of the tokenizer's
    added tokens read as ordinary text (see the module docstring)."""
    if hasattr(tokenizer, "encode_text_batch"):
        return tokenizer.encode_text_batch(texts)
    return [tokenizer.encode(text) for text in texts]


def encode_documents(docs: list[str], tokenizer) -> list[list[int]]:
    """Each document's tokens followed by end-of-text."""
    return [list(ids) + [tokenizer.eos_id] for ids in encode_texts(docs, tokenizer)]


def _hf_file(path: str) -> str:
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no tokenizer.json at {path}")
    return path


def load_tokenizer(spec: str, tokenizer_json: str | None = None):
    """The tokenizer named by `spec`; `tokenizer_json` (text) restores a trained `bpe:N`."""
    if spec == "bytes":
        return ByteTokenizer()
    if spec == "gpt2":
        with gzip.open(_ASSETS / "gpt2_tokenizer.json.gz", "rt", encoding="utf-8") as f:
            return HFTokenizer(tokenizers.Tokenizer.from_str(f.read()), spec)
    if spec.startswith("hf:"):
        return HFTokenizer(tokenizers.Tokenizer.from_file(_hf_file(spec[3:])), spec)
    if spec.startswith("bpe:"):
        if tokenizer_json is None:
            raise ValueError(f"tokenizer {spec!r} must be trained first (deltares.data.prepare does this)")
        return HFTokenizer(tokenizers.Tokenizer.from_str(tokenizer_json), spec)
    raise ValueError(f"unknown tokenizer {spec!r}; allowed: bytes, gpt2, hf:PATH, bpe:VOCAB")


def bpe_vocab_size(spec: str) -> int:
    try:
        size = int(spec[4:])
    except ValueError:
        size = 0
    if size < 300:
        raise ValueError(f"tokenizer {spec!r}: bpe:N needs an integer N >= 300")
    return size


def train_bpe(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    """A byte-level BPE of `vocab_size` (end-of-text included) trained on `texts`."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(tok, f"bpe:{vocab_size}")


def tokenizer_from_json(spec: str, tokenizer_json: str | None):
    """The tokenizer a prepared dataset was made with: its stored tokenizer.json, else its spec."""
    if tokenizer_json is not None:
        return HFTokenizer(tokenizers.Tokenizer.from_str(tokenizer_json), spec)
    return load_tokenizer(spec)


def tokenizer_sha256(spec: str, tokenizer_json: str | None) -> str:
    """The fingerprint prepare records for a tokenizer: the hash of its JSON (its spec where it has none),
    so that two tokenizers of the same size but other merges tell apart."""
    return hashlib.sha256((tokenizer_json if tokenizer_json is not None else spec).encode("utf-8")).hexdigest()


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level BPE's printable character for each byte (GPT-2's table, as `tokenizers` uses it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(shifted)}}


def export_json(tokenizer) -> str:
    """The tokenizer.json a Hugging Face export carries: the tokenizer's own JSON, or for `bytes` a byte-level
    tokenizer with the same ids (byte b is id b, end-of-text 256; no merges), which transformers and
    `hf:PATH` load as they load any other."""
    if tokenizer.spec != "bytes":
        return tokenizer.to_json()
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    vocab[EOS_NAMES[0]] = ByteTokenizer.eos_id  # in the vocabulary, not an added token: text never yields it
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def dumps_meta(meta: dict) -> str:
    return json.dumps(meta, indent=2, sort_keys=True)
