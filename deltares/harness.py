"""lm-evaluation-harness model `deltares`: loglikelihood, loglikelihood_rolling, generate_until.

    python -m deltares.harness --model deltares --model_args checkpoint=runs/demo \
        --tasks hellaswag,arc_easy,arc_challenge,piqa,winogrande,boolq,mmlu,lambada_openai --batch_size 8

`python -m deltares.harness` is the `lm_eval` command with the `deltares` model
registered (lm-eval 0.4 has no plugin mechanism for third-party models, so the plain
`lm_eval` script cannot find it); every `lm_eval` argument works. From Python,
`import deltares.harness` registers the model for `lm_eval.simple_evaluate`.
`checkpoint` is a deltares run, a checkpoint step directory or a Hugging Face Qwen3
directory. The paper's 8 tasks need their datasets from the Hugging Face Hub (or its cache).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from deltares.generate import generate
from deltares.inference import load_model


def _bucket(n: int, limit: int) -> int:
    """Padded length: the next power of two (at least 16), so few shapes get compiled."""
    return min(limit, max(16, 1 << (n - 1).bit_length()))


@register_model("deltares")
class DeltaresLM(LM):
    def __init__(self, checkpoint: str, batch_size=8, max_length=None, **kwargs):
        super().__init__()
        loaded = load_model(checkpoint)
        self.model, self.params, self.tokenizer = loaded.model, loaded.params, loaded.tokenizer
        self.max_length = int(max_length or loaded.context)
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 8
        model = self.model

        @jax.jit
        def token_logprobs(params, inputs_BT, targets_BT):
            logp_BTV = jax.nn.log_softmax(model.apply({"params": params}, inputs_BT), axis=-1)
            picked_BT = jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
            return picked_BT, jnp.argmax(logp_BTV, axis=-1) == targets_BT

        self._token_logprobs = token_logprobs

    def _score(self, pairs, disable_tqdm=False):
        """(sum log p(continuation | context), continuation is the greedy one) per (context ids,
        continuation ids) pair; contexts are cut from the left to fit `max_length`."""
        rows = []
        for ctx, cont in pairs:
            ctx = list(ctx) or [self.tokenizer.eos_id]
            full = (ctx + list(cont))[-(self.max_length + 1):]
            rows.append((full[:-1], full[1:], len(cont)))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        results = [None] * len(rows)
        for start in tqdm(range(0, len(order), self.batch_size), disable=disable_tqdm, desc="scoring"):
            idx = order[start : start + self.batch_size]
            T = _bucket(len(rows[idx[0]][0]), self.max_length)
            inputs = np.zeros((self.batch_size, T), np.int32)
            targets = np.zeros((self.batch_size, T), np.int32)
            for b, i in enumerate(idx):
                inp, tgt, _ = rows[i]
                inputs[b, : len(inp)], targets[b, : len(tgt)] = inp, tgt
            logp, greedy = jax.device_get(self._token_logprobs(self.params, inputs, targets))
            for b, i in enumerate(idx):
                n, n_cont = len(rows[i][0]), rows[i][2]
                results[i] = (float(logp[b, n - n_cont : n].sum()), bool(greedy[b, n - n_cont : n].all()))
        return results

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        pairs = [(self.tokenizer.encode(r.args[0]), self.tokenizer.encode(r.args[1])) for r in requests]
        return self._score(pairs, disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        out = []
        for r in requests:
            tokens = self.tokenizer.encode(r.args[0])
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                tokens, self.tokenizer.eos_id, self.max_length, context_len=1)]
            out.append(sum(logp for logp, _ in self._score(windows, disable_tqdm=True)))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False):
        out = []
        for r in tqdm(requests, disable=disable_tqdm, desc="generating"):
            context, gen_kwargs = r.args
            kwargs = dict(gen_kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.get("max_gen_toks", 256))
            ids = (self.tokenizer.encode(context) or [self.tokenizer.eos_id])[-max(1, self.max_length - max_new):]
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample", False) else 0.0
            tokens = generate(self.model, self.params, ids, max_new_tokens=max_new, temperature=temperature,
                              eos_id=self.tokenizer.eos_id)[0]
            text = self.tokenizer.decode(tokens)
            for stop in until:
                if stop and stop in text:
                    text = text[: text.index(stop)]
            out.append(text)
        return out


def main() -> None:
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
