"""Evaluation (`deltares.eval`) and parameters-only checkpoint loading (`deltares.training.checkpoint`).

References are written here independently of the code under test: documents are split by
hand with `re` and their bytes counted with `len(text.encode("utf-8"))`, tokens come from the
`tokenizers` library directly, and the total loss is recomputed window by window with a NumPy
log-softmax of the model's logits. The checkpoint is saved by two real training steps; the
optimizer state's array data is then deleted from it to prove a parameters-only load never
reads it. The sharded load runs in a subprocess with 8 simulated CPU devices (this file's
`__main__`), like tests/test_sharding.py.
"""

import gzip
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys

import flax.linen as nn
import jax
import ml_collections
import numpy as np
import pytest
import tensorstore as ts

from jax_cache import ENV, ROOT
from test_data import by_hash
from deltares.training.checkpoint import Checkpointer, load_checkpoint
from deltares.data.dataset import TokenData
from deltares.data.documents import DataError, builtin_path
from deltares.data.prepare import prepare
from deltares.eval import evaluate_checkpoint
from deltares.nn.model import Transformer
from deltares.training.steps import build, make_init, make_train_step

N_DOCS = 14  # the first paragraphs of Moby-Dick (../shared/corpora/mobydick.txt.gz, shipped as the built-in corpus)
VAL_FRACTION = 0.25
STEP = 2


def debug_config(dataset: str):
    spec = importlib.util.spec_from_file_location("debug", os.path.join(ROOT, "experiments", "debug.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config("delta_block")
    cfg.model.vocab_size = 512  # room for the bpe:400 vocabulary; divisible by the tensor axis
    cfg.data.tokenizer, cfg.data.dataset = "bpe:400", dataset
    return cfg


def hand_documents(text):
    """Blocks between blank lines (whitespace-only lines count as blank), stripped."""
    return [d.strip() for d in re.split(r"\n[ \t]*\n", text) if d.strip()]


def text_bytes(docs):
    """UTF-8 bytes of the documents, one more per document for the separator its end-of-text scores."""
    return sum(len(d.encode("utf-8")) for d in docs) + len(docs)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A few KB of text (.txt and .txt.gz), its bpe:400 dataset, and a run trained 2 steps on it."""
    root = tmp_path_factory.mktemp("eval")
    with gzip.open(builtin_path(), "rt", encoding="utf-8") as f:
        corpus = f.read()
    ends = [m.end() for m in re.finditer(r"\S\n[ \t]*\n", corpus)]
    text = corpus[: ends[N_DOCS - 1]]  # the raw text, its own separators, through document N_DOCS
    assert len(hand_documents(text)) == N_DOCS and any(ord(c) > 127 for c in text)  # em dashes: bytes != chars
    (root / "text.txt").write_text(text, encoding="utf-8")
    with gzip.open(root / "text.txt.gz", "wt", encoding="utf-8") as f:
        f.write(text)
    dataset = str(root / "dataset")
    prepare(str(root / "text.txt"), "bpe:400", dataset, val_fraction=VAL_FRACTION, progress=False)

    cfg = debug_config(dataset)
    model, tx, *_ = build(cfg)
    state = jax.jit(make_init(model, tx, cfg.data.seq_len))(0)
    step = jax.jit(make_train_step(model, tx))
    train = TokenData(dataset).tokens("train")
    for i in range(STEP):
        starts = np.arange(4) * cfg.data.seq_len + i
        state, _ = step(state, np.stack([train[s : s + cfg.data.seq_len + 1] for s in starts]).astype(np.int32))
    workdir = str(root / "run")
    ckpt = Checkpointer(workdir, async_save=False)
    ckpt.save(STEP, state, {}, cfg.to_dict())
    ckpt.wait()
    ckpt.close()
    return dict(root=root, text=text, dataset=dataset, workdir=workdir, cfg=cfg, state=jax.device_get(state))


def reference_nats(params, cfg, tokens, eos):
    """Total NLL of every token after a leading end-of-text, windows of seq_len targets (NumPy)."""
    model = Transformer(cfg.model)
    stream = np.concatenate([[eos], tokens]).astype(np.int32)
    apply = jax.jit(lambda p, x: model.apply({"params": p}, x))
    total, scored, L = 0.0, 0, cfg.data.seq_len
    for start in range(0, len(stream) - 1, L):
        window = stream[start : start + L + 1]
        logits = np.asarray(apply(params, window[None, :-1]), np.float64)[0]
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        total -= logp[np.arange(len(window) - 1), window[1:]].sum()
        scored += len(window) - 1
    assert scored == len(tokens)
    return total


def hand_tokens(docs, tokenizer_json, eos):
    import tokenizers

    tok = tokenizers.Tokenizer.from_str(tokenizer_json)
    return np.asarray([t for d in docs for t in tok.encode(d, add_special_tokens=False).ids + [eos]], np.int32)


def check_bits_per_byte(result, nats, n_tokens, n_bytes):
    assert result["tokens"] == n_tokens and result["bytes"] == n_bytes
    assert result["nats"] == pytest.approx(nats, rel=1e-5)
    assert result["val_loss"] == pytest.approx(nats / n_tokens, rel=1e-5)
    assert result["val_bpb"] == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-5)
    assert result["val_bpb"] != pytest.approx(result["val_loss"] / math.log(2), rel=1e-3)  # bytes != tokens here


def test_bits_per_byte_of_text_and_prepared_dataset(run):
    meta = TokenData(run["dataset"]).meta
    tokenizer_json = open(os.path.join(run["dataset"], "tokenizer.json"), encoding="utf-8").read()
    eos = meta["eos_id"]
    params = run["state"]["params"]
    docs = hand_documents(run["text"])
    train_docs, val_docs = by_hash(docs, VAL_FRACTION)  # the documents the hash of their text holds out
    # prepare counts bytes as evaluation does
    assert meta["splits"]["train"]["bytes"] == text_bytes(train_docs)
    assert meta["splits"]["val"]["bytes"] == text_bytes(val_docs)

    # the text file, plain and gzipped: every token scored, every byte counted
    tokens = hand_tokens(docs, tokenizer_json, eos)
    nats = reference_nats(params, run["cfg"], tokens, eos)
    plain = evaluate_checkpoint(run["workdir"], str(run["root"] / "text.txt"), batch=8)
    gz = evaluate_checkpoint(run["workdir"], str(run["root"] / "text.txt.gz"), batch=8)
    assert gz == plain and plain["step"] == STEP
    check_bits_per_byte(plain, nats, len(tokens), text_bytes(docs))
    L = run["cfg"].data.seq_len
    assert len(tokens) % L and (len(tokens) // L) % 8  # a short last batch and a short last window, both scored

    # the prepared dataset's validation split
    val_tokens = hand_tokens(val_docs, tokenizer_json, eos)
    np.testing.assert_array_equal(TokenData(run["dataset"]).tokens("val"), val_tokens)
    result = evaluate_checkpoint(run["workdir"], run["dataset"], batch=3)
    check_bits_per_byte(result, reference_nats(params, run["cfg"], val_tokens, eos), len(val_tokens),
                        text_bytes(val_docs))


def test_glob_and_comma_list_read_like_the_whole_text(run):
    docs = hand_documents(run["text"])
    parts = run["root"] / "parts"
    parts.mkdir()
    (parts / "a.txt").write_text("\n\n".join(docs[:5]) + "\n", encoding="utf-8")
    with gzip.open(parts / "b.txt.gz", "wt", encoding="utf-8") as f:
        f.write("\n\n\n".join(docs[5:]))
    whole = evaluate_checkpoint(run["workdir"], str(run["root"] / "text.txt"))
    assert evaluate_checkpoint(run["workdir"], str(parts / "*")) == whole
    assert evaluate_checkpoint(run["workdir"], f"{parts / 'a.txt'},{parts / 'b.txt.gz'}") == whole


def test_undecodable_text_is_an_error_naming_the_file(run, tmp_path):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9 au lait\n\nna\xefve\n".encode("latin-1"))
    binary = tmp_path / "weights.bin"
    binary.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    latin1_gz = tmp_path / "latin1.txt.gz"
    latin1_gz.write_bytes(gzip.compress(latin1.read_bytes()))
    fake_gz = tmp_path / "plain.txt.gz"
    fake_gz.write_text("not gzip\n", encoding="utf-8")
    for path in (latin1, binary, latin1_gz, fake_gz):
        with pytest.raises(DataError, match=re.escape(str(path))):  # (prepare: tests/test_data.py)
            evaluate_checkpoint(run["workdir"], str(path))
    not_dataset = tmp_path / "texts"
    not_dataset.mkdir()
    with pytest.raises(DataError, match="not a prepared dataset.*texts/\\*.txt"):
        evaluate_checkpoint(run["workdir"], str(not_dataset))
    with pytest.raises(DataError, match="matches no file"):
        evaluate_checkpoint(run["workdir"], str(tmp_path / "*.md"))

    command = [sys.executable, "-m", "deltares.eval", "--checkpoint", run["workdir"], "--data", str(latin1)]
    proc = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {latin1} line 1 is not UTF-8 text (byte 3")


def delete_optimizer_data(step_dir):
    """Deletes every optimizer-state chunk from the checkpoint's OCDBT store (array metadata stays)."""
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{step_dir}/state"}).result()
    keys = [k for k in kv.list().result() if k.startswith(b"opt_state.") and not k.endswith(b"/.zarray")]
    for key in keys:
        kv.delete_range(ts.KvStore.KeyRange(key, key + b"\0")).result()
    return len(keys)


def test_params_only_restore_never_reads_the_optimizer_state(run, tmp_path):
    model, tx, *_ = build(run["cfg"])
    abstract = jax.eval_shape(make_init(model, tx, run["cfg"].data.seq_len), 0)
    workdir = str(tmp_path / "run")
    shutil.copytree(run["workdir"], workdir)
    full, _ = Checkpointer(workdir).restore(STEP, abstract)  # intact: the full state restores
    assert max(float(np.abs(x).max()) for x in jax.tree.leaves(full["opt_state"])) > 0  # Adam moments after 2 steps

    n_opt = len(jax.tree.leaves(run["state"]["opt_state"]))
    assert delete_optimizer_data(os.path.join(workdir, "checkpoints", str(STEP))) == n_opt
    with pytest.raises(Exception, match="opt_state|array index"):
        Checkpointer(workdir).restore(STEP, abstract)
    loaded = load_checkpoint(workdir)
    assert loaded.step == STEP and set(loaded.state) == {"params"}
    got, want = jax.tree_util.tree_flatten_with_path(loaded.state["params"])[0], jax.tree.leaves(run["state"]["params"])
    assert len(got) == len(want)
    for (path, a), b in zip(got, want):
        assert a.sharding.device_set == {jax.devices()[0]}, path
        np.testing.assert_array_equal(np.asarray(a), b, err_msg=jax.tree_util.keystr(path))
    from deltares.train import _init_from  # config.init_from takes parameters only too

    zeros = jax.tree.map(np.zeros_like, run["state"]["params"])
    for a, b in zip(jax.tree.leaves(_init_from(workdir, zeros, run["cfg"].model)), want):
        np.testing.assert_array_equal(np.asarray(a), b)
    # what evaluation and generation load works on the damaged checkpoint too
    assert evaluate_checkpoint(workdir, run["dataset"]) == evaluate_checkpoint(run["workdir"], run["dataset"])


def test_init_from_takes_a_checkpoint_of_the_other_layer_layout(run, capsys):
    """config.init_from loads a run's layers into a model whose layers are the other way (stacked on a
    leading axis under nn.scan, or one parameter set per layer): every value taken, none fresh."""
    from deltares.train import _init_from

    source = run["state"]["params"]
    other = ml_collections.ConfigDict(run["cfg"].model.to_dict())
    other.scan_layers = not other.scan_layers
    tokens = np.zeros((1, 8), np.int32)
    target = jax.eval_shape(lambda: nn.meta.unbox(Transformer(other).init(jax.random.PRNGKey(0), tokens)["params"]))
    got = _init_from(run["workdir"], jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), target), other)
    assert " 0 freshly initialised" in capsys.readouterr().err
    stacked, split = (got, source) if other.scan_layers else (source, got)
    n_layers = other.n_layers
    assert set(split) == {f"layers_{i}" for i in range(n_layers)} | (set(stacked) - {"layers"})
    for path, leaf in jax.tree_util.tree_flatten_with_path(stacked["layers"])[0]:
        for i in range(n_layers):
            one = split[f"layers_{i}"]
            for key in path:
                one = one[key.key]
            np.testing.assert_array_equal(np.asarray(one), np.asarray(leaf)[i], err_msg=f"layer {i} {path}")
    for name in set(stacked) - {"layers"}:  # embedding, final norm, ...
        for a, b in zip(jax.tree.leaves(got[name]), jax.tree.leaves(source[name])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sharded_params_only_restore(run, tmp_path):
    env = dict(ENV, XLA_FLAGS=(ENV.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip())
    out = tmp_path / "params.npz"
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), run["workdir"], str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["devices"] == 8 and report["restored_keys"] == ["params"]
    assert report["embedding"] == {"spec": "P('tensor', 'fsdp')", "shard": [256, 16], "shape": [512, 32]}
    assert report["mismatched_shardings"] == []  # as training on this mesh places them
    assert report["split_fraction"] > 0.98
    saved = np.load(out)
    want = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(run["state"]["params"])[0]}
    assert sorted(saved.files) == sorted(want)
    for name, value in want.items():
        np.testing.assert_array_equal(saved[name], value, err_msg=name)


def _sharded_worker(workdir: str, out: str) -> None:
    """Loads `workdir` onto data=2, fsdp=2, tensor=2; prints shardings, saves gathered values."""
    from deltares.training.sharding import make_mesh
    from deltares.training.program import sharded_train_step

    mesh = make_mesh(dict(data=2, fsdp=2, tensor=2))
    loaded = load_checkpoint(workdir, mesh=mesh)
    training = sharded_train_step(ml_collections.ConfigDict(loaded.config), mesh).state_shardings["params"]
    flat = jax.tree_util.tree_flatten_with_path(loaded.state["params"])[0]
    mismatched = [jax.tree_util.keystr(k) for (k, a), want in zip(flat, jax.tree.leaves(training))
                  if not a.sharding.is_equivalent_to(want, a.ndim)]
    total = sum(a.nbytes for _, a in flat)
    split = sum(a.nbytes for _, a in flat if a.addressable_shards[0].data.size < a.size)
    emb = loaded.state["params"]["embed"]["embedding"]
    np.savez(out, **{jax.tree_util.keystr(k): np.asarray(a) for k, a in flat})
    print(json.dumps(dict(
        devices=jax.device_count(),
        restored_keys=sorted(loaded.state),
        embedding=dict(spec=str(emb.sharding.spec), shard=list(emb.addressable_shards[0].data.shape),
                       shape=list(emb.shape)),
        mismatched_shardings=mismatched,
        split_fraction=split / total,
    )))


if __name__ == "__main__":
    _sharded_worker(sys.argv[1], sys.argv[2])
