"""Hugging Face Qwen3 import/export and exact conversion (deltares.interop.hf, deltares.convert).

The fixtures in tests/fixtures/ were written by `transformers` (tests/make_qwen3_fixtures.py),
with the logits `transformers` computes for a fixed input: they are the independent reference.
"""

import json
import os
import shutil
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
import safetensors.numpy

from deltares.interop import hf
from deltares.nn.config import ROUTING_MODES, model_config
from deltares.nn.losses import lm_loss
from deltares.nn.model import Transformer
from deltares.interop.safetensors_io import SafetensorsFile, write

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TINY = os.path.join(HERE, "fixtures", "qwen3_tiny")
SHARDED = os.path.join(HERE, "fixtures", "qwen3_tiny_sharded")


def reference(path):
    ref = np.load(os.path.join(path, "reference.npz"))
    return ref["input_ids"], ref["logits"]


def logits_of(cfg, params, tokens):
    return np.asarray(Transformer(cfg).apply({"params": params}, tokens))


@pytest.mark.parametrize("path", [TINY, SHARDED], ids=["tied_f32", "untied_bf16_sharded"])
@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_baseline_import_matches_transformers(path, scan):
    cfg, params = hf.from_hf(path, dtype="float32", scan_layers=scan)
    assert cfg.residual.mode == "baseline" and cfg.head_dim == 24 and cfg.d_model == 64
    assert cfg.tie_embeddings == (path == TINY)
    tokens, want = reference(path)
    np.testing.assert_allclose(logits_of(cfg, params, tokens), want, rtol=0, atol=1e-4)


def _grad_fn(cfg):
    def loss_fn(p, tokens):
        return lm_loss(Transformer(cfg).apply({"params": p}, tokens[:, :-1]), tokens[:, 1:])

    return jax.jit(jax.value_and_grad(loss_fn))


def _routing_grads(grad_fn, params, tokens):
    loss, grads = grad_fn(params, tokens)
    leaves = jax.tree_util.tree_flatten_with_path(grads)[0]
    routing = {jax.tree_util.keystr(k): float(jnp.abs(g).max()) for k, g in leaves if "_router" in jax.tree_util.keystr(k)}
    return loss, grads, routing


@pytest.mark.parametrize("mode", ["delta", "delta_block"])
def test_conversion_is_exact_and_routing_learns(mode):
    cfg, params = hf.from_hf(TINY, residual={"mode": mode, "block_layers": 2}, dtype="float32", scan_layers=False)
    assert cfg.residual.gate and not cfg.residual.null_source
    tokens, want = reference(TINY)
    np.testing.assert_allclose(logits_of(cfg, params, tokens), want, rtol=0, atol=1e-4)
    base_cfg, base_params = hf.from_hf(TINY, dtype="float32", scan_layers=False)
    np.testing.assert_allclose(logits_of(cfg, params, tokens), logits_of(base_cfg, base_params, tokens), rtol=0, atol=1e-6)

    # The gate learns first (its gradient is the routed term), the pseudo-query one step later (once
    # the gate is open), the key-norm gain one step after that (its gradient is proportional to w).
    # At step 1 the zero queries weigh the sources uniformly, and the sources sum to the stream, so
    # the routed term is parallel to the stream: through the pre-norm the gate's gradient is then
    # only the norm epsilon's effect, ~1e-8, which rounding may leave at exactly 0 for a sublayer
    # (the last one, on some CPUs and XLA optimisation levels). Adam moves the gate at step 1
    # wherever that gradient is not 0; where it is, the chain starts at step 2.
    tx = optax.adam(1e-2)
    opt_state = tx.init(params)
    grad_fn, first_step = _grad_fn(cfg), {}
    for step in (1, 2, 3, 4):
        _, grads, routing = _routing_grads(grad_fn, params, tokens)
        for name, size in routing.items():
            if size > 0:
                first_step.setdefault(name, step)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    routed = [n for n in routing if "layers_0']['attn_router" not in n]  # sublayer 0 has one source: never routes
    by_router = {}
    for n in routed:
        by_router.setdefault(n.rsplit("[", 1)[0], {})[n.split("'")[-2]] = first_step.get(n)
    for router, steps in by_router.items():
        assert steps["gate"] in (1, 2), (router, steps)
        assert steps == {"gate": steps["gate"], "query": steps["gate"] + 1, "gain": steps["gate"] + 2}, (router, steps)
    assert sum(steps["gate"] == 1 for steps in by_router.values()) >= len(by_router) - 1  # at most the last waits


@pytest.mark.parametrize("residual", [{"mode": "hyper"}, {"mode": "hyper", "dynamic": False, "streams": 2},
                                      {"mode": "denseformer", "dilation": 2}])
def test_conversion_into_hyper_connections_and_denseformer_is_exact(residual):
    """Their papers' initialisations are the plain residual: a converted Qwen3 computes the pretrained function
    (hyper-connections up to the final norm's epsilon: n equal streams sum to n h), and the mixers learn."""
    cfg, params = hf.from_hf(TINY, residual=residual, dtype="float32", scan_layers=False)
    assert cfg.residual.mode == residual["mode"] and not cfg.residual.gate
    for key in ("streams", "dynamic", "dilation"):
        if key in residual:
            assert cfg.residual[key] == residual[key]
    tokens, want = reference(TINY)
    np.testing.assert_allclose(logits_of(cfg, params, tokens), want, rtol=0, atol=1e-4)
    base_cfg, base_params = hf.from_hf(TINY, dtype="float32", scan_layers=False)
    np.testing.assert_allclose(logits_of(cfg, params, tokens), logits_of(base_cfg, base_params, tokens), rtol=0,
                               atol=1e-5)
    _, _, routing = _routing_grads(_grad_fn(cfg), params, tokens)
    assert routing and max(routing.values()) > 0


def test_mhc_conversion_and_mixing_mode_exports_are_refused(tmp_path):
    with pytest.raises(hf.HFError, match="not start as a plain residual"):
        hf.from_hf(TINY, residual="mhc", dtype="float32")
    cfg, params = hf.from_hf(TINY, residual="denseformer", dtype="float32", scan_layers=False)
    with pytest.raises(hf.HFError, match="no Hugging Face model"):
        hf.to_hf(cfg, params, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_null_source_variant_is_the_papers_approximate_identity():
    cfg, params = hf.from_hf(TINY, residual={"mode": "delta", "null_source": True}, dtype="float32", scan_layers=False)
    assert cfg.residual.null_source and not cfg.residual.gate
    assert params["layers_0"]["attn_router"]["null_source"].shape == (cfg.d_model,)
    tokens, _ = reference(TINY)
    base_cfg, base_params = hf.from_hf(TINY, dtype="float32", scan_layers=False)
    diff = np.abs(logits_of(cfg, params, tokens) - logits_of(base_cfg, base_params, tokens)).max()
    # Uniform routing adds the mean of the sources: close to the pretrained function (the sublayer's
    # pre-norm hides most of it, as the mean is near a multiple of h), but not equal to it.
    assert 1e-6 < diff < 1e-2
    _, _, routing = _routing_grads(_grad_fn(cfg), params, np.concatenate([tokens, tokens[:, :1]], axis=1))
    assert all(size > 0 for name, size in routing.items() if "query" in name)  # learns from step 1


def _random_params(cfg, seed=0):
    """Model parameters with every leaf (routing ones included) random, so nothing matches by chance."""
    params = jax.jit(Transformer(cfg).init)(jax.random.key(seed), jnp.zeros((1, 4), jnp.int32))["params"]
    params = jax.tree.map(np.asarray, __import__("flax").linen.meta.unbox(params))
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), params)


def _small(mode, scan, **extra):
    return model_config(vocab_size=320, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=24, d_ff=96,
                        dtype="float32", scan_layers=scan, tie_embeddings=extra.pop("tie", True),
                        residual=dict(mode=mode, block_layers=2, **extra))


@pytest.mark.parametrize("mode", ROUTING_MODES)
@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_to_hf_then_from_hf_is_identity(tmp_path, mode, scan):
    extra = {"gate": True} if mode == "delta" else {"null_source": True} if mode == "delta_block" else {}
    cfg = _small(mode, scan, tie=mode != "full_attnres", **extra)
    params = _random_params(cfg)
    hf.to_hf(cfg, params, str(tmp_path), tokenizer=TINY)
    back_cfg, back = hf.from_hf(str(tmp_path), dtype="float32", scan_layers=scan)
    for field in hf.ARCH_FIELDS + ("scan_layers",):
        assert back_cfg[field] == cfg[field], field
    for key in hf.RESIDUAL_KEYS:
        assert back_cfg.residual[key] == cfg.residual[key], key
    jax.tree.map(np.testing.assert_array_equal, back, params)
    assert os.path.exists(tmp_path / "tokenizer.json")


def test_export_uses_the_authors_names_and_reads_with_safetensors(tmp_path):
    cfg = _small("delta", False, gate=True, null_source=True)
    params = _random_params(cfg, seed=3)
    hf.to_hf(cfg, params, str(tmp_path))
    tensors = safetensors.numpy.load_file(str(tmp_path / "model.safetensors"))  # the independent reader
    layer = params["layers_1"]
    np.testing.assert_array_equal(tensors["model.layers.1.attn_res_proj.weight"], layer["attn_router"]["query"][None])
    np.testing.assert_array_equal(tensors["model.layers.1.mlp_res_norm.weight"], layer["mlp_router"]["gain"])
    np.testing.assert_array_equal(tensors["model.layers.1.attn_null_source"], layer["attn_router"]["null_source"])
    np.testing.assert_array_equal(tensors["model.layers.1.mlp_res_gate"], layer["mlp_router"]["gate"])
    # PyTorch layout: q_proj.weight is [n_heads * head_dim, d_model], row h*24+i is head h, dim i.
    q = tensors["model.layers.1.self_attn.q_proj.weight"]
    assert q.shape == (4 * 24, 64)
    np.testing.assert_array_equal(q[2 * 24 + 5], layer["attn"]["q_proj"]["kernel"][:, 2, 5])
    assert "lm_head.weight" not in tensors  # tied
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["residual_mode"] == "delta" and config["residual_block_layers"] == 2
    assert config["architectures"] == ["DeltaResQwen3ForCausalLM"] and config["head_dim"] == 24


def test_bfloat16_export_and_sharded_index(tmp_path):
    cfg = _small("delta_block", True, gate=True)
    params = _random_params(cfg, seed=1)
    hf.to_hf(cfg, params, str(tmp_path), dtype="bfloat16", max_shard_bytes=20_000)
    index = json.loads((tmp_path / hf.INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all((tmp_path / f).exists() for f in files)
    assert not (tmp_path / hf.SINGLE).exists()
    assert SafetensorsFile(str(tmp_path / files[0])).dtype(next(iter(index["weight_map"]))) in ("BF16",)
    _, back = hf.from_hf(str(tmp_path), dtype="float32", scan_layers=True)
    rounded = jax.tree.map(lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)), params)
    jax.tree.map(np.testing.assert_array_equal, back, rounded)


# ----------------------------------------------------------------------------- bad input


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def _edit_config(path, **changes):
    file = os.path.join(path, "config.json")
    with open(file) as f:
        config = json.load(f)
    config.update(changes)
    with open(file, "w") as f:
        json.dump(config, f)


def _rewrite(path, edit):
    """Rewrites model.safetensors of `path` with `edit(dict of arrays)`."""
    file = os.path.join(path, "model.safetensors")
    reader = SafetensorsFile(file)
    tensors = {n: np.array(reader.read(n)) for n in reader.names()}
    del reader
    write(file, edit(tensors).items())


def test_safetensors_io_bfloat16_bits_and_errors(tmp_path):
    """bfloat16 goes through the library's numpy API bit for bit; bad files and tensors are named."""
    import ml_dtypes

    bits = np.array([0x3F80, 0xC0A0, 0x0001, 0x7F80], np.uint16)  # 1, -5, a subnormal, inf
    file = str(tmp_path / "x.safetensors")
    write(file, [("b", bits.view(ml_dtypes.bfloat16).reshape(2, 2)), ("i", np.arange(3, dtype=np.int64))],
          metadata={"format": "pt"})
    reader = SafetensorsFile(file)
    assert (reader.names(), reader.shape("b"), reader.dtype("b"), reader.metadata) == (
        ["b", "i"], (2, 2), "BF16", {"format": "pt"})
    np.testing.assert_array_equal(reader.read("b").view(np.uint16).ravel(), bits)
    np.testing.assert_array_equal(safetensors.numpy.load_file(file)["i"], np.arange(3))
    with pytest.raises(ValueError, match=r"x\.safetensors: tensor nope"):
        reader.read("nope")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=r"garbage\.safetensors: not a readable safetensors file"):
        SafetensorsFile(str(garbage))
    with pytest.raises(ValueError, match=r"y\.safetensors: cannot write"):
        write(str(tmp_path / "y.safetensors"), [("s", np.array(["text"]))])
    assert not os.path.exists(tmp_path / "y.safetensors.tmp")


def test_bad_checkpoints_name_the_file_or_tensor(tmp_path):
    with pytest.raises(hf.HFError, match="no such checkpoint directory"):
        hf.from_hf(str(tmp_path / "absent"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(hf.HFError, match="config.json: missing"):
        hf.from_hf(str(empty))

    llama = _copy(TINY, tmp_path / "llama")
    _edit_config(llama, model_type="llama", architectures=["LlamaForCausalLM"])
    with pytest.raises(hf.HFError, match="LlamaForCausalLM.*only Qwen3"):
        hf.from_hf(llama)

    no_weights = _copy(TINY, tmp_path / "no_weights")
    os.remove(os.path.join(no_weights, "model.safetensors"))
    with pytest.raises(hf.HFError, match="no model.safetensors"):
        hf.from_hf(no_weights)

    missing = _copy(TINY, tmp_path / "missing")
    _rewrite(missing, lambda t: {n: a for n, a in t.items() if n != "model.layers.2.mlp.up_proj.weight"})
    with pytest.raises(hf.HFError, match=r"tensor model\.layers\.2\.mlp\.up_proj\.weight: missing"):
        hf.from_hf(missing)

    unexpected = _copy(TINY, tmp_path / "unexpected")
    _rewrite(unexpected, lambda t: {**t, "model.layers.0.self_attn.q_proj.bias": np.zeros(96, np.float32)})
    with pytest.raises(hf.HFError, match=r"tensor model\.layers\.0\.self_attn\.q_proj\.bias in .*not a parameter"):
        hf.from_hf(unexpected)

    shape = _copy(TINY, tmp_path / "shape")
    _rewrite(shape, lambda t: {**t, "model.layers.1.mlp.down_proj.weight": np.zeros((64, 95), np.float32)})
    with pytest.raises(hf.HFError, match=r"down_proj\.weight in .*shape \[64, 95\], the model needs \[64, 96\]"):
        hf.from_hf(shape)

    vocab = _copy(TINY, tmp_path / "vocab")
    _edit_config(vocab, vocab_size=300)  # the tokenizer has 320 tokens
    with pytest.raises(hf.HFError, match="tokenizer.json has 320 tokens"):
        hf.from_hf(vocab)

    shards = _copy(SHARDED, tmp_path / "shards")
    os.remove(os.path.join(shards, "model-00003-of-00008.safetensors"))
    with pytest.raises(hf.HFError, match="model-00003-of-00008.safetensors: missing"):
        hf.from_hf(shards)


def test_routed_checkpoint_cannot_change_scheme(tmp_path):
    cfg, params = hf.from_hf(TINY, residual="delta", dtype="float32")
    hf.to_hf(cfg, params, str(tmp_path))
    with pytest.raises(hf.HFError, match="holds delta routing with mode='delta', not 'delta_block'"):
        hf.from_hf(str(tmp_path), residual="delta_block")


def test_to_hf_checks_before_writing(tmp_path):
    cfg = _small("delta", False)
    params = _random_params(cfg)
    params["layers_1"]["mlp"]["up_proj"]["kernel"] = np.zeros((64, 97), np.float32)
    with pytest.raises(hf.HFError, match="layers_1/mlp/up_proj/kernel: shape"):
        hf.to_hf(cfg, params, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- command line


def run_convert(*args):
    return subprocess.run([sys.executable, "-m", "deltares.convert", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)


def test_convert_cli_round_trip(tmp_path):
    out = tmp_path / "delta_block"
    proc = run_convert("--hf", TINY, "--mode", "delta_block", "--block_layers", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    cfg, params = hf.from_hf(str(out), dtype="float32")
    assert (cfg.residual.mode, cfg.residual.block_layers, cfg.residual.gate) == ("delta_block", 2, True)
    tokens, want = reference(TINY)
    np.testing.assert_allclose(logits_of(cfg, params, tokens), want, rtol=0, atol=1e-4)
    assert (out / "tokenizer.json").exists()

    workdir = tmp_path / "run"
    proc = run_convert("--hf", str(out), "--out_workdir", str(workdir))
    assert proc.returncode == 0, proc.stderr
    back = tmp_path / "back"
    proc = run_convert("--checkpoint", str(workdir), "--out", str(back), "--tokenizer", TINY)
    assert proc.returncode == 0, proc.stderr
    _, again = hf.from_hf(str(back), dtype="float32")
    jax.tree.map(np.testing.assert_array_equal, again, params)

    proc = run_convert("--hf", str(tmp_path / "nowhere"), "--mode", "delta", "--out", str(tmp_path / "x"))
    assert proc.returncode != 0 and "error:" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "x").exists()


def tree_bytes(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def bytes_run(workdir, tokenizer="bytes"):
    """A deltares run directory (step 0, random parameters) of a model trained with `tokenizer`; its
    built-in dataset was never prepared, so its tokenizer is known by its spec alone."""
    from deltares.training.checkpoint import Checkpointer
    from deltares.training.experiment import base_config

    config = base_config()
    config.model = _small("baseline", False)
    config.data.tokenizer = tokenizer
    params = _random_params(config.model, seed=5)
    ckpt = Checkpointer(str(workdir), async_save=False)
    try:
        ckpt.save(0, {"step": 0, "params": params}, {}, config.to_dict())
        ckpt.wait()
    finally:
        ckpt.close()
    return params


def test_convert_refuses_a_folder_holding_a_model_and_replaces_it_whole(tmp_path):
    """Exporting into a folder holding a Hugging Face model is refused, changing nothing; with --overwrite
    the folder holds the export alone (the old model's tokenizer and generation config are gone), and a
    `bytes` run is exported with a tokenizer.json of the same ids that `generate` loads."""
    from deltares.data.tokenizer import load_tokenizer
    from deltares.interop.inference import load_model

    params = bytes_run(tmp_path / "run")
    out = tmp_path / "exported"
    shutil.copytree(TINY, out)
    before = tree_bytes(out)
    proc = run_convert("--checkpoint", str(tmp_path / "run"), "--out", str(out))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: --out {out} holds a Hugging Face model; pass --overwrite to replace it, or choose a new --out"]
    assert tree_bytes(out) == before
    proc = run_convert("--checkpoint", str(tmp_path / "run"), "--out", str(out), "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert not [line for line in proc.stderr.splitlines() if line.startswith(("warning:", "error:"))], proc.stderr
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert sorted(os.listdir(tmp_path)) == ["exported", "run"]  # no .partial, no old folder
    _, back = hf.from_hf(str(out), dtype="float32", scan_layers=False)
    jax.tree.map(np.testing.assert_array_equal, back, params)
    text = "héllo <|endoftext|>\n\tworld"
    exported = load_tokenizer(f"hf:{out}")
    assert exported.encode(text) == list(text.encode("utf-8")) and exported.eos_id == 256
    assert load_model(str(out)).tokenizer.decode(list(text.encode("utf-8"))) == text


def test_an_export_that_fails_midway_leaves_the_folder_whole(tmp_path):
    """deltares.data.paths.write_whole, which every command's output goes through: the disk fills after the
    weights are written; the folder it was to replace is as it was, and no partial export is left."""
    from deltares.convert import hf_to_hf
    from deltares.data import paths

    out = tmp_path / "model"
    shutil.copytree(TINY, out)
    before = tree_bytes(out)

    def fills_the_disk(folder):
        hf_to_hf(TINY, folder, {"mode": "delta", "null_source": False})
        assert os.path.exists(os.path.join(folder, "model.safetensors"))
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        paths.write_whole(str(out), fills_the_disk, overwrite=True)
    assert tree_bytes(out) == before and sorted(os.listdir(tmp_path)) == ["model"]


def test_export_of_a_run_whose_tokenizer_is_gone_warns(tmp_path, capsys):
    from deltares.convert import workdir_to_hf

    bytes_run(tmp_path / "run", tokenizer="bpe:300")  # trained on a dataset since deleted
    workdir_to_hf(str(tmp_path / "run"), str(tmp_path / "out"))
    assert not (tmp_path / "out" / "tokenizer.json").exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: no tokenizer.json written") and "--tokenizer" in err[0], err


# ----------------------------------------------------------------------------- fine-tuning


def test_finetune_from_hf_lowers_the_loss(tmp_path):
    """Step 0 of `train` with init_from_hf (converted delta_block, gate 0) has the pretrained
    model's loss on its first batch, and fine-tuning lowers it. The reference loss is the plain
    baseline import's (deltares.interop.hf.from_hf), which test_baseline_import_matches_transformers
    checks against the logits `transformers` computed; a random init gives another loss."""
    from deltares.data.dataset import TokenData, train_dataset
    from deltares.data.run_data import run_dataset_path
    from deltares.train import train

    sys.path.insert(0, ROOT)
    from experiments.finetune_qwen3_0p6b import get_config

    cfg = get_config("delta_block,block_layers=2")
    assert cfg.model.residual.gate and cfg.optim.routing_lr == 5e-3 and cfg.data.tokenizer == "init_from_hf"
    small, _ = hf.from_hf(TINY, residual=cfg.model.residual.to_dict(), dtype="float32", scan_layers=False)
    cfg.model = small
    cfg.init_from_hf = TINY
    cfg.data.seq_len = 32
    cfg.train.update(global_batch=4, steps=20, log_every=1, eval_every=20, eval_batches=2, stats_every=0,
                     checkpoint_every=20)
    cfg.optim.update(lr=3e-3, lr_min=3e-4, routing_lr=3e-2, warmup_steps=2)
    result = train(cfg, str(tmp_path))
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    first, last = records[0]["loss"], np.mean([r["loss"] for r in records[-3:]])

    # records[0] is step 1: the loss of the initial parameters on the first batch.
    data = TokenData(run_dataset_path(cfg, str(tmp_path)))
    batch = np.asarray(train_dataset(data.tokens("train"), cfg.data.seq_len, cfg.train.global_batch, cfg.seed)[0])
    assert batch.shape == (4, 33)
    base_cfg, base_params = hf.from_hf(TINY, dtype="float32", scan_layers=False)
    pretrained = float(lm_loss(Transformer(base_cfg).apply({"params": base_params}, batch[:, :-1]), batch[:, 1:]))
    assert first == pytest.approx(pretrained, rel=1e-5), (first, pretrained)
    fresh = nn.meta.unbox(Transformer(small).init(jax.random.key(cfg.seed), batch[:, :-1]))["params"]
    random_init = float(lm_loss(Transformer(small).apply({"params": fresh}, batch[:, :-1]), batch[:, 1:]))
    assert abs(random_init - pretrained) > 0.1, (random_init, pretrained)  # the check sees unloaded weights
    assert last < first - 0.2, (first, last)
    assert np.isfinite(result["val_ppl"])
    from deltares.training.checkpoint import load_checkpoint

    params = load_checkpoint(str(tmp_path)).state["params"]
    assert float(np.abs(params["layers_2"]["mlp_router"]["gate"]).max()) > 0  # routing moved off the identity
    assert float(np.abs(params["layers_2"]["mlp_router"]["query"]).max()) > 0
    assert ml_collections.ConfigDict(load_checkpoint(str(tmp_path), want_state=False).config).init_from_hf == TINY
