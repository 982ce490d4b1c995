"""Next-token cross-entropy, plain and chunked over the sequence."""

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
    return masked_mean(token_nll(logits_BTV, targets_BT), mask_BT)


def masked_mean(nll_BT, mask_BT=None):
    """Mean of `nll_BT` over the tokens where `mask_BT` is true (all by default)."""
    if mask_BT is None:
        return nll_BT.mean()
    mask = mask_BT.astype(jnp.float32)
    return (nll_BT * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def head_token_nll(x_BTD, kernel_DV, targets_BT, chunk: int = 0, dtype=jnp.float32):
    """Per-token NLL [B, T] of the logits `x_BTD @ kernel_DV` (computed in `dtype`, softmax in
    float32), `chunk` tokens of every sequence at a time (0: all at once).

    Chunked, the logits of one chunk ([B, chunk, V]) are all that exists at a time: the loop
    over chunks is a scan whose body is rematerialised, so the backward pass recomputes each
    chunk's logits instead of keeping [B, T, V] float32 logits alive (the largest activation of
    a training step at Qwen3's 151,936-token vocabulary). The batch axis stays whole, so its
    sharding is untouched; T that `chunk` does not divide is padded (and the padding dropped)."""
    B, T, D = x_BTD.shape

    def nll(x_BWD, targets_BW):
        logits_BWV = jnp.einsum("bwd,dv->bwv", x_BWD.astype(dtype), kernel_DV.astype(dtype))
        return token_nll(logits_BWV, targets_BW)

    if not chunk or chunk >= T:
        return nll(x_BTD, targets_BT)
    n_chunks = -(-T // chunk)
    pad = n_chunks * chunk - T
    x_GBWD = jnp.pad(x_BTD, ((0, 0), (0, pad), (0, 0))).reshape(B, n_chunks, chunk, D).swapaxes(0, 1)
    targets_GBW = jnp.pad(targets_BT, ((0, 0), (0, pad))).reshape(B, n_chunks, chunk).swapaxes(0, 1)
    nll_GBW = jax.lax.map(lambda args: jax.checkpoint(nll)(*args), (x_GBWD, targets_GBW))
    return nll_GBW.swapaxes(0, 1).reshape(B, n_chunks * chunk)[:, :T]


__all__ = ["head_token_nll", "lm_loss", "masked_mean", "token_nll"]
