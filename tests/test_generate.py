"""Decoding with a KV cache (deltares.generate); the lm-eval adapter is in tests/test_harness.py.

References: the model's own full forward pass (no cache), and NumPy for sampling filters.
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deltares.nn.config import MODES, model_config
from deltares.generate import generate, read_prompts, sample_logits
from deltares.interop.inference import load_model
from deltares.nn.model import Transformer, init_cache
from jax_cache import run_module
from roundoff import assert_close, with_tolerance

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
    full, tol = with_tolerance(jax.jit(lambda p: model.apply({"params": p}, tokens)), params,
                               stages=2 * model.config.n_layers + 2)  # float32 op-order noise: tests/roundoff.py
    step = jax.jit(lambda p, x, cache, pos: model.apply({"params": p}, x, cache=cache, pos=pos))
    cache = init_cache(model.config, 2, 12)
    logits, cache = step(params, tokens[:, :4], cache, 0)  # prefill
    steps = [logits]
    for t in range(4, 9):
        logits, cache = step(params, tokens[:, t : t + 1], cache, t)
        steps.append(logits)
    assert_close(np.concatenate(steps, axis=1), full, tol)


def greedy_reference(model, params, prompt, n, eos=None, min_new=0, width=32):
    """Greedy continuation without a cache: the whole sequence (right-padded; causal) through
    the model each step; end-of-text banned for the first `min_new` tokens, ends the row after."""
    forward = jax.jit(model.apply)
    seq = list(prompt)
    for i in range(n):
        logits = np.array(forward({"params": params}, jnp.asarray([seq + [0] * (width - len(seq))]))[0, len(seq) - 1])
        if eos is not None and i < min_new:
            logits[eos] = -np.inf
        seq.append(int(np.argmax(logits)))
        if seq[-1] == eos:
            return seq[len(prompt) : -1]
    return seq[len(prompt) :]


PROMPTS = [[5, 9, 2], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [33, 20, 20, 8, 1]]  # lengths 3, 1, 11, 5


@pytest.mark.parametrize("mode,scan", [("baseline", True), ("delta_block", True), ("full_attnres", False)])
def test_padded_batch_greedy_equals_each_prompt_alone_and_full_forward(mode, scan):
    model, params = random_model(mode, scan=scan, seed=3)
    batch = generate(model, params, PROMPTS, max_new_tokens=6, temperature=0.0)
    assert [c.text for c in batch] == [None] * len(PROMPTS)
    for prompt, got in zip(PROMPTS, batch):
        assert got.tokens == greedy_reference(model, params, prompt, 6)
    alone = generate(model, params, PROMPTS[2:3], max_new_tokens=6, temperature=0.0)  # a batch of one: no padding rows
    assert alone[0].tokens == batch[2].tokens
    twice = generate(model, params, PROMPTS[:2], max_new_tokens=6, temperature=0.0, num_samples=2)  # prompt-major
    assert [c.tokens for c in twice] == [batch[0].tokens] * 2 + [batch[1].tokens] * 2


def test_each_row_stops_at_end_of_text_or_after_min_new_tokens():
    model, params = random_model("delta", scan=False, seed=4)
    free = [c.tokens for c in generate(model, params, PROMPTS, max_new_tokens=8, temperature=0.0)]
    eos = free[0][3]
    stopped = generate(model, params, PROMPTS, max_new_tokens=8, temperature=0.0, eos_id=eos)
    for row, got in zip(free, stopped):  # rows without `eos` run on to max_new_tokens
        assert got.tokens == (row[: row.index(eos)] if eos in row else row)
    assert len({len(c.tokens) for c in stopped}) > 1  # the rows end at different steps
    first = free[1][0]  # the first new token of prompt 1: it ends at once unless banned
    assert generate(model, params, PROMPTS[1:2], max_new_tokens=8, temperature=0.0, eos_id=first)[0].tokens == []
    banned = generate(model, params, PROMPTS, max_new_tokens=8, min_new_tokens=3, temperature=0.0, eos_id=first)
    for prompt, got in zip(PROMPTS, banned):
        want = greedy_reference(model, params, prompt, 8, eos=first, min_new=3)
        assert got.tokens == want and len(got.tokens) >= 3 and first not in got.tokens


def test_stop_strings_cut_the_text_of_each_row():
    from deltares.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()  # ids 0..63 of the random model are the bytes 0..63 (digits, punctuation, newline)
    model, params = random_model("delta_block", scan=True, seed=5)
    free = generate(model, params, PROMPTS, max_new_tokens=10, temperature=0.0, tokenizer=tok)
    texts = [tok.decode(c.tokens) for c in free]
    assert [c.text for c in free] == texts
    stop = texts[0][4:6]  # two characters, spanning tokens 4 and 5 of row 0
    absent = "\x7f"  # never generated (vocabulary 64)
    got = generate(model, params, PROMPTS, max_new_tokens=10, temperature=0.0, tokenizer=tok, stop=[absent, stop])
    for text, row, c in zip(texts, free, got):
        cut = text.find(stop)
        if cut < 0:
            assert c.text == text and c.tokens == row.tokens
        else:  # byte tokens: the stop string ends at token cut + len(stop); generation ends there
            assert c.text == text[:cut] and c.tokens == row.tokens[: cut + len(stop)]
    assert got[0].text == texts[0][: texts[0].find(stop)] and len(got[0].tokens) <= 6
    with pytest.raises(ValueError, match="tokenizer"):
        generate(model, params, PROMPTS, max_new_tokens=3, stop=["x"])


def test_no_recompilation_within_a_bucket():
    # A config no other test uses, so the first call must compile.
    cfg = model_config(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=40,
                       dtype="float32", scan_layers=True, residual=dict(mode="delta_block", block_layers=1))
    model = Transformer(cfg)
    params = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    lowered = []

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":  # each lowering, even on a disk-cache hit
            lowered.append(kwargs.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        settings = dict(max_new_tokens=5, temperature=0.7, top_k=10, top_p=0.9)
        calls = [([[1, 2, 3], [4]], {}), ([[5, 6, 7, 8, 9, 10, 11], [2, 2]], dict(seed=3)),
                 ([[9] * 12, [3, 1, 4, 1, 5]], dict(min_new_tokens=2, eos_id=7)),
                 ([[4, 4], [1]], dict(max_new_tokens=3))]
        counts = []  # prompt lengths 1..12 (bucket 16), the cache within 16 (12 + 5 - 1): one set of shapes
        for prompts, kw in calls:
            before = len(lowered)
            generate(model, params, prompts, **{**settings, **kw})
            counts.append(len(lowered) - before)
        before = len(lowered)
        generate(model, params, [[1] * 20, [2]], **settings)  # the next length bucket
        longer = len(lowered) - before
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert counts[0] >= 2 and counts[1:] == [0, 0, 0], (counts, lowered)
    assert longer >= 2  # the counter sees compilations: a prompt of 20 tokens is in the next length bucket


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
    for prompts in ([], [[]], [[1, 2], []]):
        with pytest.raises(ValueError, match="empty"):
            generate(model, params, prompts, max_new_tokens=3)
    with pytest.raises(ValueError, match="list of token-id lists"):
        generate(model, params, [1, 2], max_new_tokens=3)


# ----------------------------------------------------------------------------- command lines


def test_prompt_files(tmp_path):
    lines = tmp_path / "prompts.txt"
    lines.write_text("Call me Ishmael.\n\nThe whale \r\n")
    assert read_prompts(str(lines)) == ["Call me Ishmael.", "The whale "]
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('"a\\nb"\n{"prompt": "c", "id": 3}\n')
    assert read_prompts(str(jsonl)) == ["a\nb", "c"]
    for bad, message in [("not json\n", "line 1 is not JSON"), ('"ok"\n{"text": "x"}\n', "line 2")]:
        jsonl.write_text(bad)
        with pytest.raises(ValueError, match=message):
            read_prompts(str(jsonl))


def test_generate_cli(converted_run_dir, tmp_path):
    proc = run_module("deltares.generate", "--checkpoint", converted_run_dir, "--prompt", "Call me Ishmael.",
                      "--max_new_tokens", "8", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Call me Ishmael.") and len(proc.stdout.strip()) > len("Call me Ishmael.")
    proc = run_module("deltares.generate", "--checkpoint", TINY_HF, "--prompt", "Call me", "--max_new_tokens", "4",
                      "--temperature", "0")  # a Hugging Face directory directly
    assert proc.returncode == 0 and proc.stdout.startswith("Call me"), proc.stderr

    # A batch from a JSONL file (a prompt may hold a newline), cut at a stop string, against the API.
    prompts = ["Call me", "The whale\nwas", "It"]
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text(f'{json.dumps(prompts[0])}\n{json.dumps({"prompt": prompts[1]})}\n\n{json.dumps(prompts[2])}\n')
    proc = run_module("deltares.generate", "--checkpoint", converted_run_dir, "--prompt_file", str(jsonl), "--max_new_tokens",
                      "7", "--min_new_tokens", "7", "--temperature", "0", "--stop", " the", "--stop", "\\n")
    assert proc.returncode == 0, proc.stderr
    loaded = load_model(converted_run_dir)
    tok = loaded.tokenizer
    want = generate(loaded.model, loaded.params, [tok.encode(p) for p in prompts], max_new_tokens=7,
                    min_new_tokens=7, temperature=0.0, stop=[" the", "\n"], tokenizer=tok)
    assert proc.stdout == "".join(f"--- prompt {i}\n{p}{c.text}\n" for i, (p, c) in enumerate(zip(prompts, want)))
    assert f"[{sum(len(c.tokens) for c in want)} tokens in" in proc.stderr
    proc = run_module("deltares.generate", "--checkpoint", converted_run_dir, "--prompt", "Call me", "--prompt", "It",
                      "--max_new_tokens", "3", "--num_samples", "2", "--seed", "1")
    assert proc.returncode == 0, proc.stderr
    heads = [line for line in proc.stdout.splitlines() if line.startswith("---")]
    assert heads == ["--- prompt 0 sample 0", "--- prompt 0 sample 1", "--- prompt 1 sample 0", "--- prompt 1 sample 1"]

    for args, message in [
        (["--prompt", "  "], "error: the prompt is empty"),
        (["--prompt_file", str(tmp_path / "absent.txt")], "error:"),
    ]:
        proc = run_module("deltares.generate", "--checkpoint", converted_run_dir, *args)
        assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr
    empty = tmp_path / "empty_run"
    empty.mkdir()
    proc = run_module("deltares.generate", "--checkpoint", str(empty), "--prompt", "x")
    assert proc.returncode != 0 and "no checkpoint in" in proc.stderr and "Traceback" not in proc.stderr

    other = tmp_path / "other_config"  # parameters of one model, the saved config of another
    shutil.copytree(converted_run_dir, other)
    meta = other / "checkpoints" / "0" / "config" / "metadata"
    config = json.loads(meta.read_text())
    config["model"]["d_ff"] = 128
    meta.write_text(json.dumps(config))
    proc = run_module("deltares.generate", "--checkpoint", str(other), "--prompt", "x")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "does not match its saved config" in proc.stderr and "down_proj" in proc.stderr

