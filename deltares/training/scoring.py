"""Scoring a model on batches: loss, perplexity and bits per byte (the trainer's validation and
`deltares.eval` share it)."""

from __future__ import annotations

import math


def score(eval_step, params, batches) -> tuple[float, int]:
    """(total nats, tokens scored) over `batches`."""
    total, count = 0.0, 0
    for batch in batches:
        nll, n = eval_step(params, batch)
        total += float(nll)
        count += int(n)
    return total, count


def metrics(nats: float, count: int, n_bytes: float) -> dict:
    """Mean token loss (nats), perplexity and bits per byte of `count` tokens spelling `n_bytes` bytes."""
    loss = nats / count
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)), "val_bpb": nats / math.log(2) / n_bytes}


def evaluate(eval_step, params, batches, bytes_per_token: float) -> dict:
    """Loss, perplexity and bits per byte over `batches`, bytes at the split's mean per token."""
    nats, count = score(eval_step, params, batches)
    return metrics(nats, count, count * bytes_per_token)
