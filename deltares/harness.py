"""lm-evaluation-harness model `deltares`: loglikelihood, loglikelihood_rolling, generate_until.

    python -m deltares.harness --model deltares --model_args checkpoint=runs/demo \
        --tasks hellaswag,arc_easy,arc_challenge,piqa,winogrande,boolq,mmlu,lambada_openai --batch_size 8

`python -m deltares.harness` is the `lm_eval` command with the `deltares` model
registered (lm-eval 0.4 has no plugin mechanism for third-party models, so the plain
`lm_eval` script cannot find it); every `lm_eval` argument works. From Python,
`import deltares.harness` registers the model for `lm_eval.simple_evaluate`.
`checkpoint` is a deltares run, a checkpoint step directory or a Hugging Face Qwen3
directory. The paper's 8 tasks need their datasets from the Hugging Face Hub (or its cache).

The model follows lm-eval's `hf` model (lm_eval/models/huggingface.py): `TemplateLM` does
the context/continuation encoding (trailing spaces move to the continuation; the context is
the prefix of the whole text's encoding; an empty context is the prefix token), contexts
too long for `max_length` are cut from the left, documents are scored in lm-eval's rolling
windows, and `batch_size=auto` searches the largest batch that runs, from `max_batch_size`
down by halves. tests/test_harness.py checks the log-likelihoods against the `hf` model.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from deltares.common.domains import AT_LEAST_1
from deltares.nn.config import DTYPES
from deltares.generate import bucket, generate
from deltares.interop.inference import load_model
from deltares.nn.model import Transformer


def parse_batch_size(value) -> int | str:
    """A positive integer, or "auto" (search the largest batch that runs)."""
    text = str(value).strip()
    if text == "auto":
        return "auto"
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise ValueError(f"batch_size={value!r}: must be a positive integer or 'auto' "
                     "(deltares searches once, at max_length; there is no auto:N schedule)")


@register_model("deltares")
class DeltaresLM(TemplateLM):
    """`checkpoint`: a run, step or Hugging Face directory; `max_length`: tokens of context
    (default: the training sequence length); `dtype`: compute dtype (default: the checkpoint's;
    float32 for exact scores); `batch_size`: rows per call, or auto up to `max_batch_size`."""

    def __init__(self, checkpoint: str, batch_size=8, max_batch_size=64, max_length=None, dtype=None,
                 device=None, **kwargs):
        super().__init__()
        if kwargs:
            raise ValueError(f"unknown deltares model arguments: {', '.join(sorted(kwargs))} (allowed: checkpoint, "
                             "batch_size, max_batch_size, max_length, dtype)")
        del device  # JAX places the model on its default devices
        self.batch_size = parse_batch_size(batch_size)
        for name, value in (("max_length", max_length), ("max_batch_size", max_batch_size)):
            problem = value is not None and AT_LEAST_1.problem(value)
            if problem:
                raise ValueError(f"{name}={value!r}: {problem}")
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r}: allowed {', '.join(DTYPES)}")
        loaded = load_model(checkpoint)
        model, self.params, self.tokenizer = loaded.model, loaded.params, loaded.tokenizer
        if dtype is not None:
            model = Transformer(ml_collections.ConfigDict({**model.config.to_dict(), "dtype": dtype}))
        self.model = model
        self.max_length = int(max_length or loaded.context)
        self.max_batch_size = int(max_batch_size or 64)
        self._rows = self.batch_size if self.batch_size != "auto" else None

        @jax.jit
        def token_logprobs(params, inputs_BT, targets_BT):
            logits_BTV = model.apply({"params": params}, inputs_BT).astype(jnp.float32)
            logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
            picked_BT = jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
            return picked_BT, jnp.argmax(logp_BTV, axis=-1) == targets_BT

        self._token_logprobs = token_logprobs

    # ------------------------------------------------------------------ TemplateLM's hooks

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def max_gen_toks(self) -> int:
        return 256

    def tok_encode(self, string: str, add_special_tokens=None, left_truncate_len=None, **kwargs) -> list[int]:
        """Token ids (the deltares tokenizers add no special tokens), the last `left_truncate_len`."""
        ids = self.tokenizer.encode(string)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens) -> str:
        return self.tokenizer.decode(tokens)

    # ------------------------------------------------------------------ scoring

    def _detect_batch_size(self) -> int:
        """The largest batch, from `max_batch_size` down by halves, that scores `max_length`
        tokens; an over-large one fails with RESOURCE_EXHAUSTED (hf's search, for XLA)."""
        rows = self.max_batch_size
        while True:
            zeros_BT = np.zeros((rows, self.max_length), np.int32)
            try:
                jax.block_until_ready(self._token_logprobs(self.params, zeros_BT, zeros_BT))
                return rows
            except jax.errors.JaxRuntimeError as err:
                if "RESOURCE_EXHAUSTED" not in str(err) or rows == 1:
                    raise
                rows //= 2

    def rows_per_batch(self) -> int:
        if self._rows is None:
            self._rows = self._detect_batch_size()
            print(f"batch_size=auto: the largest batch that runs is {self._rows}")
        return self._rows

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """(sum log p(continuation | context), whether the continuation is greedy) per
        (key, context ids, continuation ids); the whole is cut from the left to fit `max_length`."""
        for _, ctx, cont in requests:
            if not ctx or not cont or len(cont) > self.max_length:
                raise ValueError(f"a request of {len(ctx)} context and {len(cont)} continuation tokens: both must be "
                                 f"non-empty and the continuation at most max_length={self.max_length}")
        order = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])))
        B = self.rows_per_batch()
        res = []
        chunks = order.get_batched(n=B)
        for chunk in tqdm(chunks, total=-(-len(requests) // B), disable=disable_tqdm, desc="scoring"):
            seqs = [(ctx + cont)[-(self.max_length + 1):] for _, ctx, cont in chunk]
            T = min(self.max_length, bucket(max(len(s) for s in seqs) - 1))  # few shapes to compile
            inputs_BT, targets_BT = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
            for b, s in enumerate(seqs):
                inputs_BT[b, : len(s) - 1], targets_BT[b, : len(s) - 1] = s[:-1], s[1:]
            logp_BT, greedy_BT = jax.device_get(self._token_logprobs(self.params, inputs_BT, targets_BT))
            for b, ((key, _, cont), s) in enumerate(zip(chunk, seqs)):
                scored = slice(len(s) - 1 - len(cont), len(s) - 1)
                answer = (float(logp_BT[b, scored].sum(dtype=np.float64)), bool(greedy_BT[b, scored].all()))
                res.append(answer)
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
        return order.get_original(res)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        """Sum of log p over each document, in lm-eval's disjoint windows of `max_length`
        tokens (each after one token of context; the first after the prefix token)."""
        windows, counts = [], []
        for (string,) in [r.args for r in requests]:
            doc = [(None,) + make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            windows += doc
            counts.append(len(doc))
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        out, start = [], 0
        for r, n in zip(requests, counts):
            total = sum(logp for logp, _ in scores[start : start + n])
            start += n
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, total)
            out.append(total)
        return out

    # ------------------------------------------------------------------ generation

    def generate_until(self, requests, disable_tqdm: bool = False):
        """Greedy (or sampled, with do_sample) continuations, a batch of contexts with the same
        generation arguments at a time, cut before the first stop string (end-of-text is one);
        each context is cut from the left to leave room for `max_gen_toks`."""
        eos = self.tok_decode([self.eot_token_id])
        order = Collator([r.args for r in requests], sort_fn=lambda a: (-len(self.tok_encode(a[0])), a[0]),
                         group_by="gen_kwargs", group_fn=lambda a: a[1])
        res = []
        pbar = tqdm(total=len(requests), disable=disable_tqdm, desc="generating")
        for chunk in order.get_batched(n=self.rows_per_batch()):
            contexts, all_kwargs = zip(*chunk)
            kwargs = normalize_gen_kwargs(all_kwargs[0] or {}, self.max_gen_toks)  # the same for the chunk
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_new = kwargs.pop("max_gen_toks")
            if max_new >= self.max_length:
                raise ValueError(f"max_gen_toks={max_new} must be less than max_length={self.max_length}")
            prompts = [self.tok_encode(c, left_truncate_len=self.max_length - max_new) or [self.prefix_token_id]
                       for c in contexts]
            sample = kwargs.get("do_sample", False)
            outs = generate(self.model, self.params, prompts, max_new_tokens=max_new, eos_id=self.eot_token_id,
                            stop=until, tokenizer=self.tokenizer,
                            temperature=float(kwargs.get("temperature", 0.0)) if sample else 0.0,
                            top_k=int(kwargs.get("top_k", 0)), top_p=float(kwargs.get("top_p", 1.0)))
            for (context, gen_kwargs), out in zip(chunk, outs):
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), out.text)
                res.append(out.text)
            pbar.update(len(chunk))
        pbar.close()
        return order.get_original(res)


def main() -> None:
    """The command line (`python -m deltares.harness`, `deltares-harness`): lm-eval's, with `deltares` registered."""
    from lm_eval.__main__ import cli_evaluate

    from deltares import command_line

    command_line.handle_interrupts()
    command_line.quiet_libtpu_off_tpu()
    try:
        cli_evaluate()
    except (OSError, ValueError) as err:  # bad model arguments, a missing checkpoint or task
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
