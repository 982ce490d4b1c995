"""Document masks (`config.data.document_mask`): in a window holding documents A|B, each token sees
only its own document with positions restarting there, so the losses of A and of B equal those of
each computed alone; off, the model is the plain causal one."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deltares.nn.config import model_config
from deltares.nn.model import Transformer
from deltares.training.steps import batch_nll, document_segments
from roundoff import assert_close, with_tolerance

EOS = 63
nll = jax.jit(batch_nll, static_argnums=(0, 3))  # (model, params, tokens, eos_id or None)


def tiny_model(mode, scan, tied=True, remat="none"):
    cfg = model_config(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                       dtype="float32", scan_layers=scan, loss_chunk=0, tie_embeddings=tied, remat=remat,
                       residual=dict(mode=mode, block_layers=1))
    return Transformer(cfg)


def test_segments_start_at_end_of_text():
    tokens = jnp.asarray([[5, 6, EOS, 7, 8, EOS, 9], [EOS, 1, 2, 3, 4, 5, 6]])
    np.testing.assert_array_equal(document_segments(tokens, EOS), [[0, 0, 1, 1, 1, 2, 2], [1, 1, 1, 1, 1, 1, 1]])


@pytest.mark.parametrize("mode,scan,remat", [("baseline", True, "none"), ("delta_block", False, "none"),
                                             ("full_attnres", True, "full"), ("delta", True, "full")])
def test_a_window_of_two_documents_scores_each_as_if_alone(mode, scan, remat):
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, EOS, 9).tolist(), rng.integers(0, EOS, 12).tolist()
    window = jnp.asarray([a + [EOS] + b])  # inputs a, eos, b[:-1]; targets a[1:], eos, b
    model = tiny_model(mode, scan, remat=remat)  # remat full: the store-once depth pass
    params = jax.jit(model.init)(jax.random.key(0), window[:, :-1])["params"]
    masked = np.asarray(nll(model, params, window, EOS))[0]
    stages = 2 * model.config.n_layers + 2  # float32 rounding of each: tests/roundoff.py
    alone_a, tol_a = with_tolerance(lambda p: nll(model, p, jnp.asarray([a + [EOS]]), None)[0], params, stages=stages)
    alone_b, tol_b = with_tolerance(lambda p: nll(model, p, jnp.asarray([[EOS] + b]), None)[0], params, stages=stages)
    assert_close(masked[: len(a)], alone_a, tol_a)  # targets a[1:], eos
    assert_close(masked[len(a):], alone_b, tol_b)  # targets b after its eos
    plain = np.asarray(nll(model, params, window, None))[0]
    assert np.abs(plain[len(a):] - alone_b).max() > 1e-3  # without the mask B sees A: the test tells them apart


def test_gradients_flow_only_within_documents():
    model = tiny_model("delta_block", True, tied=False)  # the embedding rows feed the inputs only
    window = jnp.asarray([[1, 2, 3, EOS, 4, 5, 6, 7]])
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(1), window[:, :-1])["params"])
    embed = params["embed"]["embedding"]

    def b_loss(e):
        nll = batch_nll(model, {**params, "embed": {"embedding": e}}, window, EOS)[0]
        return nll[3:].sum()  # the targets of the second document

    grad = jax.jit(jax.grad(b_loss))(embed)
    assert float(jnp.abs(grad[jnp.asarray([1, 2])]).max()) == 0.0  # tokens only the first document holds
