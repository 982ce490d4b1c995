"""Routed Hugging Face exports run in PyTorch (deltares/interop/hf_remote/, written by deltares.interop.hf.to_hf).

For every residual mode (and the gate and null-source options), a tiny model with random,
non-trivial routing parameters is exported, loaded by `transformers` with
`trust_remote_code=True`, and checked against deltares: logits, greedy KV-cache `generate`,
and `save_pretrained` then `hf.from_hf` back to the same parameters. torch and transformers
are test-only requirements (requirements-test.txt).
"""

import copy
import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing may come from the network

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from deltares.interop import hf  # noqa: E402
from deltares.nn.config import model_config  # noqa: E402
from deltares.convert import hf_to_hf  # noqa: E402
from deltares.nn.model import Transformer  # noqa: E402

PROMPT, NEW = 6, 4
VARIANTS = {
    "full_attnres": dict(mode="full_attnres"),
    "block_attnres": dict(mode="block_attnres"),
    "delta": dict(mode="delta"),
    "delta_gate": dict(mode="delta", gate=True),
    "delta_null": dict(mode="delta", null_source=True),
    "delta_block": dict(mode="delta_block"),
    "delta_block_gate": dict(mode="delta_block", gate=True),
    "delta_block_null_nopartial": dict(mode="delta_block", null_source=True, include_partial=False),
}


def _config(residual, tie=True):
    return model_config(vocab_size=100, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=96,
                        dtype="float32", scan_layers=True, tie_embeddings=tie, rope_theta=10000.0,
                        residual=dict(block_layers=2, **residual))


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny tensors on a shared 2-core machine: more threads only contend."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _random_params(cfg, seed):
    """Every parameter moved away from its initial value (zeros, or ones for norm scales and
    key-norm gains): weights by N(0, 0.1); pseudo-queries N(0, 0.5) (not zero), gains
    1 + N(0, 0.5) (not one), gates 0.5 + N(0, 0.2) (not zero), null sources N(0, 1).
    Built from the abstract parameters, so no initialisation is compiled."""
    shapes = nn.meta.unbox(jax.eval_shape(Transformer(cfg).init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
    rng = np.random.default_rng(seed)
    base = {"scale": 1.0, "gain": 1.0, "gate": 0.5}
    scale = {"query": 0.5, "gain": 0.5, "gate": 0.2, "null_source": 1.0}

    def draw(path, x):
        leaf = str(path[-1].key)
        return (base.get(leaf, 0.0) + scale.get(leaf, 0.1) * rng.normal(size=x.shape)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(draw, shapes["params"])


def _greedy(cfg, params, tokens_BP, n):
    """deltares' greedy continuation by full forwards at one fixed length (causal: later slots don't matter)."""
    forward = jax.jit(lambda t: Transformer(cfg).apply({"params": params}, t))
    tokens = np.concatenate([tokens_BP, np.zeros((tokens_BP.shape[0], n), np.int32)], axis=1)
    for k in range(n):
        tokens[:, PROMPT + k] = np.asarray(forward(tokens))[:, PROMPT + k - 1].argmax(-1)
    return tokens, np.asarray(forward(tokens))


@pytest.fixture(scope="module", params=list(VARIANTS))
def exported(request, tmp_path_factory):
    """(cfg, params, export dir, the PyTorch model loaded from it, tokens [B, P+N] of deltares' greedy
    run, deltares' logits on them)."""
    name = request.param
    cfg = _config(VARIANTS[name], tie=name != "full_attnres")
    params = _random_params(cfg, seed=len(name))
    path = str(tmp_path_factory.mktemp(name))
    hf.to_hf(cfg, params, path)
    prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(2, PROMPT)).astype(np.int32)
    tokens, logits = _greedy(cfg, params, prompt, NEW)
    config = json.load(open(os.path.join(path, "config.json")))
    assert config["model_type"] == "deltares_qwen3" and config["architectures"] == ["DeltaResQwen3ForCausalLM"]
    return cfg, params, path, _load(path), tokens, logits


def _load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32)


def test_pytorch_logits_and_generate_equal_deltares(exported):
    cfg, params, path, model, tokens, logits = exported
    assert type(model).__name__ == "DeltaResQwen3ForCausalLM"
    with torch.no_grad():
        got = model(torch.from_numpy(tokens).long()).logits.numpy()
    np.testing.assert_allclose(got, logits, rtol=0, atol=1e-4)
    assert np.abs(logits).max() > 1.0  # not a trivially small function
    with torch.no_grad():
        out = model.generate(torch.from_numpy(tokens[:, :PROMPT]).long(), max_new_tokens=NEW, min_new_tokens=NEW,
                             do_sample=False, use_cache=True, pad_token_id=0)
    np.testing.assert_array_equal(out.numpy(), tokens)


def test_routing_changes_the_pytorch_function(exported):
    """The routing parameters matter in PyTorch: zeroing the pseudo-queries changes the logits."""
    cfg, params, path, model, tokens, logits = exported
    model = copy.deepcopy(model)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "res_proj" in pname:
                p.zero_()
        got = model(torch.from_numpy(tokens).long()).logits.numpy()
    assert np.abs(got - logits).max() > 1e-2


def test_save_pretrained_reads_back_identical(exported, tmp_path):
    cfg, params, path, model, tokens, logits = exported
    model.save_pretrained(str(tmp_path))
    saved = json.load(open(tmp_path / "config.json"))
    assert saved["model_type"] == "deltares_qwen3" and saved["residual_mode"] == cfg.residual.mode
    back_cfg, back = hf.from_hf(str(tmp_path), dtype="float32", scan_layers=True)
    for field in hf.ARCH_FIELDS:
        assert back_cfg[field] == cfg[field], field
    for key in hf.RESIDUAL_KEYS:
        assert back_cfg.residual[key] == cfg.residual[key], key
    jax.tree.map(np.testing.assert_array_equal, back, params)
    # save_pretrained carries the PyTorch model along: the saved directory loads again.
    with torch.no_grad():
        again = _load(str(tmp_path))(torch.from_numpy(tokens).long()).logits.numpy()
    np.testing.assert_allclose(again, logits, rtol=0, atol=1e-4)


def test_routed_export_refused_without_trust_remote_code(tmp_path):
    """Also for an export of the old kind (routed, but `model_type: qwen3`) rewritten by
    `deltares.convert`'s --hf --out."""
    cfg = _config(dict(mode="delta_block", gate=True))
    old, new = tmp_path / "old", tmp_path / "new"
    hf.to_hf(cfg, _random_params(cfg, seed=0), str(old))
    config = json.load(open(old / "config.json"))
    config.pop("auto_map")
    (old / "config.json").write_text(json.dumps(dict(config, model_type="qwen3")))
    for file in hf.REMOTE_FILES:
        os.remove(old / file)
    hf_to_hf(str(old), str(new))
    assert json.load(open(new / "config.json"))["model_type"] == "deltares_qwen3"
    with pytest.raises(ValueError, match="trust_remote_code"):
        transformers.AutoModelForCausalLM.from_pretrained(str(new), dtype=torch.float32)
    model = _load(str(new))
    assert model.model.layers[1].mlp_res_gate.shape == (1,)


def test_baseline_export_is_plain_qwen3(tmp_path):
    cfg = _config(dict(mode="baseline"))
    params = _random_params(cfg, seed=2)
    hf.to_hf(cfg, params, str(tmp_path))
    config = json.load(open(tmp_path / "config.json"))
    assert config["model_type"] == "qwen3" and "auto_map" not in config
    assert not any(f.endswith(".py") for f in os.listdir(tmp_path))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(2, 8)).astype(np.int32)
    want = np.asarray(Transformer(cfg).apply({"params": params}, tokens))
    with torch.no_grad():
        got = model(torch.from_numpy(tokens).long()).logits.numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
