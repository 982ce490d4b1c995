"""Next-token cross-entropy."""

import jax
import jax.numpy as jnp


def token_nll(logits_BTV, targets_BT):
    """Per-token negative log-likelihood [B, T] in float32."""
    logits = logits_BTV.astype(jnp.float32)
    log_z_BT = jax.nn.logsumexp(logits, axis=-1)
    target_logit_BT = jnp.take_along_axis(logits, targets_BT[..., None], axis=-1)[..., 0]
    return log_z_BT - target_logit_BT


def lm_loss(logits_BTV, targets_BT, mask_BT=None):
    """Mean next-token cross-entropy over the tokens where `mask_BT` is true (all by default)."""
    nll_BT = token_nll(logits_BTV, targets_BT)
    if mask_BT is None:
        return nll_BT.mean()
    mask = mask_BT.astype(jnp.float32)
    return (nll_BT * mask).sum() / jnp.maximum(mask.sum(), 1.0)
