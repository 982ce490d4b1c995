"""Sample text from a trained model with a KV cache, for every residual mode.

    python -m deltares.generate --checkpoint runs/demo --prompt "Call me Ishmael." \
        --max_new_tokens 100 --temperature 0.8 --top_k 50 --top_p 0.95
    python -m deltares.generate --checkpoint /path/to/Qwen3-0.6B --prompt_file prompt.txt --temperature 0

The prompt is run once through the model (prefill), then one token per step. Depth
routing is per token, so the cache holds only attention keys and values; the routed
sources of a new token are computed from that token alone. Stops at end-of-text.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from deltares.inference import load_model
from deltares.model import init_cache


def sample_logits(logits_BV, key, temperature: float, top_k: int, top_p: float):
    """Next tokens [B] from float32 logits: greedy at temperature 0, else softmax(logits / T)
    restricted to the `top_k` most likely tokens (0: all) and the smallest set of tokens whose
    probability reaches `top_p` (1: all)."""
    if temperature <= 0:
        return jnp.argmax(logits_BV, axis=-1)
    logits_BV = logits_BV / temperature
    V = logits_BV.shape[-1]
    sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
    if 0 < top_k < V:
        logits_BV = jnp.where(logits_BV < sorted_BV[:, top_k - 1 : top_k], -jnp.inf, logits_BV)
        sorted_BV = jnp.where(jnp.arange(V) < top_k, sorted_BV, -jnp.inf)
    if top_p < 1.0:
        probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
        before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV  # mass of the tokens ranked above
        kept = jnp.sum(before_BV < top_p, axis=-1, keepdims=True)  # always >= 1
        cutoff_B1 = jnp.take_along_axis(sorted_BV, kept - 1, axis=-1)
        logits_BV = jnp.where(logits_BV < cutoff_B1, -jnp.inf, logits_BV)
    return jax.random.categorical(key, logits_BV, axis=-1)


def generate(model, params, prompt_ids, *, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, eos_id: int | None = None, num_samples: int = 1, seed: int = 0):
    """`num_samples` continuations (lists of token ids, end-of-text excluded) of `prompt_ids`."""
    if not len(prompt_ids):
        raise ValueError("the prompt is empty")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be at least 1")
    P = len(prompt_ids)
    cache = init_cache(model.config, num_samples, P + max_new_tokens)
    prompt_BP = jnp.tile(jnp.asarray(prompt_ids, jnp.int32)[None], (num_samples, 1))

    @jax.jit
    def prefill(params, tokens_BP, cache, key):
        logits_BPV, cache = model.apply({"params": params}, tokens_BP, cache=cache, pos=0)
        return sample_logits(logits_BPV[:, -1], key, temperature, top_k, top_p), cache

    @jax.jit
    def decode(params, token_B, cache, pos, key):
        logits_B1V, cache = model.apply({"params": params}, token_B[:, None], cache=cache, pos=pos)
        return sample_logits(logits_B1V[:, 0], key, temperature, top_k, top_p), cache

    keys = jax.random.split(jax.random.key(seed), max_new_tokens)
    token_B, cache = prefill(params, prompt_BP, cache, keys[0])
    out = [token_B]
    done = np.zeros(num_samples, bool)
    for step in range(1, max_new_tokens):
        if eos_id is not None:
            done |= np.asarray(token_B) == eos_id
            if done.all():
                break
        token_B, cache = decode(params, token_B, cache, jnp.int32(P + step - 1), keys[step])
        out.append(token_B)
    tokens_BN = np.stack([np.asarray(t) for t in out], axis=1)
    samples = []
    for row in tokens_BN.tolist():
        if eos_id is not None and eos_id in row:
            row = row[: row.index(eos_id)]
        samples.append(row)
    return samples


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    if not _CHECKPOINT.value:
        raise app.UsageError("--checkpoint is required")
    if bool(_PROMPT.value) == bool(_PROMPT_FILE.value):
        sys.exit("error: give exactly one of --prompt or --prompt_file")
    try:
        prompt = _PROMPT.value
        if _PROMPT_FILE.value:
            with open(_PROMPT_FILE.value, encoding="utf-8") as f:
                prompt = f.read()
        if not prompt.strip():
            raise ValueError("the prompt is empty")
        loaded = load_model(_CHECKPOINT.value)
        ids = loaded.tokenizer.encode(prompt)
        start = time.perf_counter()
        samples = generate(loaded.model, loaded.params, ids, max_new_tokens=_MAX_NEW.value, temperature=_TEMP.value,
                           top_k=_TOP_K.value, top_p=_TOP_P.value, eos_id=loaded.tokenizer.eos_id,
                           num_samples=_NUM.value, seed=_SEED.value)
    except (OSError, ValueError) as err:
        sys.exit(f"error: {err}")
    elapsed = time.perf_counter() - start
    for i, sample in enumerate(samples):
        if len(samples) > 1:
            print(f"--- sample {i}")
        print(prompt + loaded.tokenizer.decode(sample))
    n = sum(len(s) for s in samples)
    print(f"[{n} tokens in {elapsed:.1f} s, compilation included]", file=sys.stderr)


if __name__ == "__main__":  # flags only for the command line, so modules import side by side
    _CHECKPOINT = flags.DEFINE_string("checkpoint", None, "A run directory, step directory or Hugging Face directory.")
    _PROMPT = flags.DEFINE_string("prompt", None, "The text to continue.")
    _PROMPT_FILE = flags.DEFINE_string("prompt_file", None, "A file holding the text to continue.")
    _MAX_NEW = flags.DEFINE_integer("max_new_tokens", 100, "Tokens to generate at most.")
    _TEMP = flags.DEFINE_float("temperature", 0.8, "Sampling temperature; 0 is greedy.")
    _TOP_K = flags.DEFINE_integer("top_k", 50, "Sample among the k most likely tokens (0: all).")
    _TOP_P = flags.DEFINE_float("top_p", 0.95, "Nucleus sampling mass (1: all).")
    _NUM = flags.DEFINE_integer("num_samples", 1, "Continuations to sample.")
    _SEED = flags.DEFINE_integer("seed", 0, "Random seed.")
    app.run(main)
