"""Sample text from a trained model with a KV cache, for every residual mode and a batch of prompts.

    python -m deltares.generate --checkpoint runs/demo --prompt "Call me Ishmael." \
        --max_new_tokens 100 --min_new_tokens 20 --temperature 0.8 --top_k 50 --top_p 0.95
    python -m deltares.generate --checkpoint /path/to/Qwen3-0.6B --prompt_file prompts.jsonl --stop "\n" --temperature 0

Prompts of different lengths are right-padded to a bucketed length and run once through
the model together (prefill; causal attention keeps real tokens off the padding after
them); then each row decodes one token per step at its own position: the rows are
vmapped, so each writes its cache slot and attends to slots 0..pos only (padding never,
RoPE positions from 0). Depth routing is per token, so the cache holds only attention
keys and values. A row stops at end-of-text or a stop string; the loop ends when all have.
The compiled prefill and decode are cached per (model, bucketed shapes, sampling
settings), so calls with other prompts in the same buckets compile nothing.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from deltares.common.domains import AT_LEAST_1, NON_NEGATIVE, Domain, define_number
from deltares.common.inputs import DataError, resolve_inputs
from deltares.data import formats
from deltares.interop.inference import load_model
from deltares.nn.model import init_cache
from deltares.training.checkpoint import CheckpointError


class Sampling(NamedTuple):
    """Static sampling settings: greedy at temperature 0, else softmax(logits / T) over the
    `top_k` most likely tokens (0: all) and the smallest set reaching mass `top_p` (1: all)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


# The numbers of a request (`generate`'s arguments, the command's flags): temperature 0 is greedy,
# top_k 0 keeps every token, top_p 1 the whole mass (0 would keep none).
REQUEST_DOMAINS = {
    "max_new_tokens": AT_LEAST_1, "min_new_tokens": NON_NEGATIVE, "num_samples": AT_LEAST_1,
    "temperature": NON_NEGATIVE, "top_k": NON_NEGATIVE, "top_p": Domain(0, 1, low_open=True), "seed": NON_NEGATIVE,
}


class Continuation(NamedTuple):
    tokens: list[int]  # generated ids: end-of-text excluded, nothing after the token completing a stop string
    text: str | None  # decoded tokens cut before the first stop string (None without a tokenizer)


def bucket(n: int, least: int = 16) -> int:
    """Padded size of n: the next power of two, at least `least`, so few shapes get compiled."""
    return max(least, 1 << (max(n, 1) - 1).bit_length())


def sample_logits(logits_BV, key, temperature: float, top_k: int, top_p: float):
    """Next tokens [B] from float32 logits (see `Sampling`)."""
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


def _next(logits_BV, key, step, sampling: Sampling, eos_id, allow_eos):
    """Sampled tokens of new-token `step` (its key folded in here, so no call compiles a
    split of its own length); end-of-text (id `eos_id`, -1: none) is banned unless `allow_eos`."""
    banned_V = (jnp.arange(logits_BV.shape[-1]) == eos_id) & ~allow_eos
    key = jax.random.fold_in(key, step)
    return sample_logits(jnp.where(banned_V, -jnp.inf, logits_BV), key, *sampling).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("model", "sampling"), donate_argnames=("cache",))
def _prefill(model, sampling, params, tokens_BP, lengths_B, cache, key, eos_id, allow_eos):
    """All right-padded prompts at once (pos 0); the first new token of each row, sampled
    from the logits at its last real token."""
    logits_B1V, cache = model.apply({"params": params}, tokens_BP, cache=cache, pos=0, logits_at=lengths_B - 1)
    return _next(logits_B1V[:, 0], key, 0, sampling, eos_id, allow_eos), cache


@functools.partial(jax.jit, static_argnames=("model", "sampling"), donate_argnames=("cache",))
def _decode(model, sampling, params, token_B, cache, pos_B, key, step, eos_id, allow_eos):
    """One token per row, row b at position pos_B[b]; the cache is [L, B, C, K, E] (k, v)."""

    def row(token, cache_row, pos):  # a batch of one, so `pos` may differ between rows
        logits_11V, cache_row = model.apply({"params": params}, token[None, None],
                                            cache=jax.tree.map(lambda c: c[:, None], cache_row), pos=pos)
        return logits_11V[0, 0], jax.tree.map(lambda c: c[:, 0], cache_row)

    logits_BV, cache = jax.vmap(row, in_axes=(0, 1, 0), out_axes=(0, 1))(token_B, cache, pos_B)
    return _next(logits_BV, key, step, sampling, eos_id, allow_eos), cache


def _stop_at(text: str, stop: list[str]) -> int | None:
    """Index of the earliest stop string in `text`, or None."""
    found = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(found) if found else None


def generate(model, params, prompts: list[list[int]], *, max_new_tokens: int, min_new_tokens: int = 0,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, eos_id: int | None = None,
             stop: list[str] | None = None, tokenizer=None, num_samples: int = 1,
             seed: int = 0) -> list[Continuation]:
    """`num_samples` continuations of each prompt (lists of token ids), prompt-major: those of
    prompt i are at i * num_samples ... A row ends at end-of-text (`eos_id`, by default the
    tokenizer's; never among the first `min_new_tokens`, all of them when that exceeds
    `max_new_tokens`), at any of the `stop` strings (needs
    `tokenizer`; the text is cut before it, as lm-eval's generate_until expects), or after
    `max_new_tokens`."""
    _check_request(prompts, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, num_samples=num_samples,
                   temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    stop = [s for s in (stop or []) if s]
    if stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer")
    if eos_id is None and tokenizer is not None:
        eos_id = tokenizer.eos_id
    rows = [list(p) for p in prompts for _ in range(num_samples)]
    B, P = bucket(len(rows), least=1), bucket(max(len(r) for r in rows))
    S = bucket(max(P, max(len(r) for r in rows) + max_new_tokens - 1))  # the last new token is not fed back
    tokens_BP = np.zeros((B, P), np.int32)
    lengths_B = np.ones(B, np.int32)  # rows past the batch: one padding token each, done from the start
    for b, r in enumerate(rows):
        tokens_BP[b, : len(r)], lengths_B[b] = r, len(r)
    sampling = Sampling(float(temperature), int(top_k), float(top_p)) if temperature > 0 else Sampling(0.0)
    eos = jnp.int32(-1 if eos_id is None else eos_id)

    key = jax.random.key(seed)
    token_B, cache = _prefill(model, sampling, params, tokens_BP, lengths_B, init_cache(model.config, B, S),
                              key, eos, jnp.bool_(min_new_tokens == 0))
    out = [[] for _ in rows]
    text: list[str | None] = [None] * len(rows)
    done = np.arange(B) >= len(rows)
    for step in range(max_new_tokens):
        if step:
            token_B, cache = _decode(model, sampling, params, token_B, cache, jnp.asarray(lengths_B + step - 1),
                                     key, jnp.int32(step), eos, jnp.bool_(step >= min_new_tokens))
        for b, t in enumerate(np.asarray(token_B)[: len(rows)].tolist()):
            if done[b]:
                continue
            if t == eos_id:
                done[b] = True
                continue
            out[b].append(t)
            if stop:
                decoded = tokenizer.decode(out[b])
                cut = _stop_at(decoded, stop)
                if cut is not None:
                    done[b], text[b] = True, decoded[:cut]
        if done.all():
            break
    if tokenizer is not None:
        text = [t if t is not None else tokenizer.decode(o) for t, o in zip(text, out)]
    return [Continuation(o, t) for o, t in zip(out, text)]


def _check_request(prompts, **numbers) -> None:
    """ValueError naming what is wrong with a `generate` request (its prompts, its `numbers` by
    REQUEST_DOMAINS)."""
    if isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], (int, np.integer)):
        raise ValueError("prompts must be a list of token-id lists (a batch), not one list of ids")
    if not prompts or any(not len(p) for p in prompts):
        raise ValueError("the prompt is empty")
    for name, value in numbers.items():
        problem = REQUEST_DOMAINS[name].problem(value)
        if problem:
            raise ValueError(f"{name}={value} {problem}")


def fit_context(prompts: list[list[int]], context: int) -> tuple[list[list[int]], list[str]]:
    """Prompts cut to their last `context` tokens (the model's training sequence length: it never saw
    longer ones, and the cache and prefill grow with the prompt), with a warning for each cut one."""
    fitted, warnings = [], []
    for i, ids in enumerate(prompts):
        if len(ids) > context:
            warnings.append(f"warning: prompt {i} has {len(ids)} tokens, more than the model's context of {context} "
                            f"(its training sequence length): only its last {context} are used")
            ids = ids[-context:]
        fitted.append(ids)
    return fitted, warnings


def read_prompts(spec: str) -> list[str]:
    """Prompts of the files `spec` names (paths and globs, comma-separated, as every input:
    deltares.common.inputs), file after file: in a JSON Lines file (named `.jsonl`, `.ndjson` or `.json`) one
    JSON string (or object with "prompt") per line, so prompts may hold newlines; in any other text file one
    prompt per non-empty line. Compressed files are read; a byte-order mark is no part of a prompt. DataError
    naming the file (and line) for a file that is no text, text that is not UTF-8, or a line that is no prompt."""
    prompts = []
    for path in resolve_inputs(spec, flag="--prompt_file", pipes=True):  # `<(...)` and /dev/stdin too: read once
        data, fmt = formats.read_whole(path)
        if fmt.kind not in (formats.TEXT, formats.JSON_LINES):
            raise DataError(f"--prompt_file {path} is a {fmt} file; prompts are read from text or JSON Lines files")
        text = formats.decode_text(data, path).replace("\r\n", "\n").replace("\r", "\n")  # universal newlines
        lines = text.split("\n")
        if not formats.named_json_lines(path):
            prompts += [line for line in lines if line.strip()]
            continue
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path} line {n} is not JSON: {err}") from None
            item = item.get("prompt") if isinstance(item, dict) else item
            if not isinstance(item, str):
                raise DataError(f'{path} line {n}: need a JSON string or an object with a "prompt" string')
            if any(0xD800 <= ord(c) <= 0xDFFF for c in item):
                raise DataError(f"{path} line {n}: the prompt holds a lone surrogate, which is no text")
            prompts.append(item)
    return prompts


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    if not _CHECKPOINT.value:
        raise app.UsageError("--checkpoint is required")
    if bool(_PROMPT.value) == bool(_PROMPT_FILE.value):
        sys.exit("error: give --prompt (once or more) or --prompt_file, not both")
    try:
        prompts = list(_PROMPT.value or []) or read_prompts(_PROMPT_FILE.value)
        if not prompts or any(not p.strip() for p in prompts):
            raise ValueError("the prompt is empty")
        loaded = load_model(_CHECKPOINT.value)
        ids, warnings = fit_context([loaded.tokenizer.encode(p) for p in prompts], loaded.context)
        for warning in warnings:
            print(warning, file=sys.stderr)
        start = time.perf_counter()
        stop = [s.replace("\\n", "\n").replace("\\t", "\t") for s in _STOP.value or []]  # "\n" typed
        samples = generate(loaded.model, loaded.params, ids, max_new_tokens=_MAX_NEW.value,
                           min_new_tokens=_MIN_NEW.value, temperature=_TEMP.value, top_k=_TOP_K.value,
                           top_p=_TOP_P.value, stop=stop, tokenizer=loaded.tokenizer, num_samples=_NUM.value,
                           seed=_SEED.value)
    except (OSError, ValueError, CheckpointError) as err:
        sys.exit(f"error: {err}")
    elapsed = time.perf_counter() - start
    for i, sample in enumerate(samples):
        p, s = divmod(i, _NUM.value)
        if len(samples) > 1:
            print("---" + (f" prompt {p}" if len(prompts) > 1 else "") + (f" sample {s}" if _NUM.value > 1 else ""))
        print(prompts[p] + sample.text)
    n = sum(len(s.tokens) for s in samples)
    print(f"[{n} tokens in {elapsed:.1f} s, compilation included]", file=sys.stderr)


def cli() -> None:
    """The command line (`python -m deltares.generate`, `deltares-generate`); flags only here, so modules
    import side by side."""
    global _CHECKPOINT, _PROMPT, _PROMPT_FILE, _MAX_NEW, _MIN_NEW, _TEMP, _TOP_K, _TOP_P, _STOP, _NUM, _SEED
    from deltares import command_line

    _CHECKPOINT = flags.DEFINE_string("checkpoint", None, "A run directory, step directory or Hugging Face directory.")
    _PROMPT = flags.DEFINE_multi_string("prompt", None, "The text to continue; give it several times for a batch.")
    _PROMPT_FILE = flags.DEFINE_string("prompt_file", None, "Files of prompts (paths and globs, comma-separated): one "
                                       'per line (a .jsonl file: one JSON string or {"prompt": ...} per line).')
    integer = functools.partial(define_number, flags.DEFINE_integer)
    number = functools.partial(define_number, flags.DEFINE_float)
    _MAX_NEW = integer("max_new_tokens", 100, "Tokens to generate at most.", REQUEST_DOMAINS["max_new_tokens"])
    _MIN_NEW = integer("min_new_tokens", 0, "End-of-text is not sampled before this many tokens.",
                       REQUEST_DOMAINS["min_new_tokens"])
    _TEMP = number("temperature", 0.8, "Sampling temperature (0: greedy).", REQUEST_DOMAINS["temperature"])
    _TOP_K = integer("top_k", 50, "Sample among the k most likely tokens (0: all).", REQUEST_DOMAINS["top_k"])
    _TOP_P = number("top_p", 0.95, "Nucleus sampling mass (1: all).", REQUEST_DOMAINS["top_p"])
    _STOP = flags.DEFINE_multi_string("stop", None, "Stop a continuation at this string (cut from the output); "
                                      "may be given several times; \\n and \\t are a newline and a tab.")
    _NUM = integer("num_samples", 1, "Continuations to sample per prompt.", REQUEST_DOMAINS["num_samples"])
    _SEED = integer("seed", 0, "Random seed.", REQUEST_DOMAINS["seed"])
    command_line.run(main)


if __name__ == "__main__":
    cli()
