"""Decoding with a KV cache (deltares.generate) and the lm-evaluation-harness adapter (deltares.harness).

References: the model's own full forward pass (no cache), and NumPy for sampling filters.
"""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deltares.config import MODES, model_config
from deltares.convert import hf_to_workdir
from deltares.generate import generate, sample_logits
from deltares.model import Transformer, init_cache

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TINY_HF = os.path.join(HERE, "fixtures", "qwen3_tiny")


def random_model(mode, scan, seed=0):
    cfg = model_config(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48,
                       dtype="float32", scan_layers=scan, residual=dict(mode=mode, block_layers=2))
    model = Transformer(cfg)
    params = model.init(jax.random.key(seed), jnp.zeros((1, 4), jnp.int32))["params"]
    keys = iter(jax.random.split(jax.random.key(seed + 1), 100))
    # Random routing parameters too, so that routing is far from uniform.
    params = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape), params)
    return model, params


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_cached_decoding_equals_full_forward(mode, scan):
    model, params = random_model(mode, scan)
    tokens = jax.random.randint(jax.random.key(7), (2, 9), 0, 64)
    full = jax.jit(model.apply)({"params": params}, tokens)
    step = jax.jit(lambda p, x, cache, pos: model.apply({"params": p}, x, cache=cache, pos=pos))
    cache = init_cache(model.config, 2, 12)
    logits, cache = step(params, tokens[:, :4], cache, 0)  # prefill
    steps = [logits]
    for t in range(4, 9):
        logits, cache = step(params, tokens[:, t : t + 1], cache, t)
        steps.append(logits)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=1e-4, atol=1e-5)  # float32 op-order noise


@pytest.mark.parametrize("mode", ["baseline", "delta_block"])
def test_greedy_generation_equals_argmax_of_full_forward(mode):
    model, params = random_model(mode, scan=True, seed=3)
    prompt = [5, 9, 2]
    got = generate(model, params, prompt, max_new_tokens=6, temperature=0.0)[0]
    forward = jax.jit(model.apply)
    seq = list(prompt)
    for _ in range(6):  # no cache: the whole sequence (right-padded; causal) through the model each time
        padded = jnp.asarray([seq + [0] * (9 - len(seq))])
        seq.append(int(jnp.argmax(forward({"params": params}, padded)[0, len(seq) - 1])))
    assert got == seq[len(prompt) :]


def test_generation_stops_at_end_of_text():
    model, params = random_model("delta", scan=False, seed=4)
    free = generate(model, params, [1, 2], max_new_tokens=8, temperature=0.0)[0]
    eos = free[3]
    stopped = generate(model, params, [1, 2], max_new_tokens=8, temperature=0.0, eos_id=eos)[0]
    assert stopped == free[: free.index(eos)]


def test_sampling_filters_against_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(1, 50)).astype(np.float32) * 2
    order = np.argsort(-logits[0])
    probs = np.exp(logits[0] - logits[0].max())
    probs /= probs.sum()
    cum = np.cumsum(probs[order])
    nucleus = set(order[: int(np.searchsorted(cum, 0.7) + 1)].tolist())  # smallest set reaching 0.7
    draws = lambda **kw: {int(sample_logits(jnp.asarray(logits), jax.random.key(i), **kw)[0]) for i in range(300)}  # noqa: E731
    assert draws(temperature=1.0, top_k=5, top_p=1.0) <= set(order[:5].tolist())
    assert draws(temperature=1.0, top_k=0, top_p=0.7) <= nucleus
    assert len(draws(temperature=1.0, top_k=0, top_p=0.7)) > 1
    assert draws(temperature=1.0, top_k=1, top_p=1.0) == {int(order[0])}
    assert draws(temperature=0.0, top_k=0, top_p=1.0) == {int(order[0])}
    assert len(draws(temperature=1.0, top_k=0, top_p=1.0)) > 10


def test_empty_prompt_is_an_error():
    model, params = random_model("baseline", scan=False)
    with pytest.raises(ValueError, match="empty"):
        generate(model, params, [], max_new_tokens=3)


# ----------------------------------------------------------------------------- command lines


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A deltares run directory holding the tiny Qwen3 converted to delta_block (exact)."""
    path = tmp_path_factory.mktemp("gen") / "run"
    hf_to_workdir(TINY_HF, str(path), {"mode": "delta_block", "block_layers": 2})
    return str(path)


def run_module(module, *args):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=600)


def test_generate_cli(run_dir, tmp_path):
    proc = run_module("deltares.generate", "--checkpoint", run_dir, "--prompt", "Call me Ishmael.",
                      "--max_new_tokens", "8", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Call me Ishmael.") and len(proc.stdout.strip()) > len("Call me Ishmael.")
    proc = run_module("deltares.generate", "--checkpoint", TINY_HF, "--prompt", "Call me", "--max_new_tokens", "4",
                      "--temperature", "0")  # a Hugging Face directory directly
    assert proc.returncode == 0 and proc.stdout.startswith("Call me"), proc.stderr

    for args, message in [
        (["--prompt", "  "], "error: the prompt is empty"),
        (["--prompt_file", str(tmp_path / "absent.txt")], "error:"),
    ]:
        proc = run_module("deltares.generate", "--checkpoint", run_dir, *args)
        assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr
    empty = tmp_path / "empty_run"
    empty.mkdir()
    proc = run_module("deltares.generate", "--checkpoint", str(empty), "--prompt", "x")
    assert proc.returncode != 0 and "no checkpoint in" in proc.stderr and "Traceback" not in proc.stderr

    other = tmp_path / "other_config"  # parameters of one model, the saved config of another
    shutil.copytree(run_dir, other)
    meta = other / "checkpoints" / "0" / "config" / "metadata"
    config = json.loads(meta.read_text())
    config["model"]["d_ff"] = 128
    meta.write_text(json.dumps(config))
    proc = run_module("deltares.generate", "--checkpoint", str(other), "--prompt", "x")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "does not match its saved config" in proc.stderr and "down_proj" in proc.stderr


def test_harness_scores_like_the_model(run_dir):
    from lm_eval.api.instance import Instance

    from deltares.harness import DeltaresLM

    lm = DeltaresLM.create_from_arg_string(f"checkpoint={run_dir}", {"batch_size": 2})
    tok = lm.tokenizer
    pairs = [("Call me", " Ishmael."), ("The whale", " was white and vast"), ("", "Hello there")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    got = lm.loglikelihood(requests, disable_tqdm=True)
    for (ctx, cont), (logp, greedy) in zip(pairs, got):
        ctx_ids, cont_ids = tok.encode(ctx) or [tok.eos_id], tok.encode(cont)
        seq = jnp.asarray([ctx_ids + cont_ids])
        logp_TV = jax.nn.log_softmax(lm.model.apply({"params": lm.params}, seq[:, :-1])[0], axis=-1)
        picked = [float(logp_TV[len(ctx_ids) - 1 + i, t]) for i, t in enumerate(cont_ids)]
        assert logp == pytest.approx(sum(picked), abs=1e-4)
        argmax = [int(jnp.argmax(logp_TV[len(ctx_ids) - 1 + i])) for i in range(len(cont_ids))]
        assert greedy == (argmax == cont_ids)

    text = "It was the best of times, it was the worst of times."
    rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)[0]
    ids = [tok.eos_id] + tok.encode(text)  # shorter than the context: one window after end-of-text
    logp_TV = jax.nn.log_softmax(lm.model.apply({"params": lm.params}, jnp.asarray([ids[:-1]]))[0], axis=-1)
    assert rolling == pytest.approx(float(sum(logp_TV[i, t] for i, t in enumerate(ids[1:]))), abs=1e-3)

    out = lm.generate_until([Instance("generate_until", {}, ("Call me", {"until": ["\n"], "max_gen_toks": 6}), 0)],
                            disable_tqdm=True)
    assert isinstance(out[0], str) and "\n" not in out[0]


def test_harness_cli_runs_a_local_task(run_dir, tmp_path):
    proc = run_module("deltares.harness", "--model", "deltares", "--model_args", f"checkpoint={run_dir}",
                      "--tasks", "deltares_tiny", "--include_path", "tests/lm_eval_tasks", "--batch_size", "2",
                      "--output_path", str(tmp_path / "results"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "deltares_tiny" in proc.stdout and "acc" in proc.stdout
    assert any(f.endswith(".json") for _, _, files in os.walk(tmp_path / "results") for f in files)

    proc = run_module("deltares.harness", "--model", "deltares", "--model_args", f"checkpoint={run_dir}",
                      "--tasks", "no_such_task_xyz")
    assert proc.returncode != 0 and "no_such_task_xyz" in proc.stderr + proc.stdout
