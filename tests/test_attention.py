"""The attention implementations (`config.model.attention`, deltares.nn.attention) compute causal
grouped-query attention exactly as a NumPy reference; splash (the TPU Pallas kernel) runs in the
Pallas interpreter here, and its gradients match XLA's. cuDNN needs a GPU: on a CPU only its refusal,
on a GPU (`JAX_PLATFORMS=cuda python -m pytest tests/test_attention.py -k cudnn`) its output and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deltares.nn import attention
from deltares.nn.attention import _query_blocks, auto_is_cudnn, causal_attention, check_attention, splash_block
from deltares.nn.config import model_config
from deltares.nn.model import Transformer

B, T, H, K, E = 2, 256, 4, 2, 16


def numpy_attention(q, k, v, segments=None):
    """Causal grouped-query attention in float64: query head h reads key/value head h // (H / K)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, h, e = q.shape
    kv_of = np.arange(h) // (h // k.shape[2])
    logits = np.einsum("bqhe,bkhe->bhqk", q, k[:, :, kv_of]) / np.sqrt(e)
    allowed = np.tril(np.ones((t, t), bool))[None]
    if segments is not None:
        allowed = allowed & (segments[:, :, None] == segments[:, None, :])
    logits = np.where(allowed[:, None], logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhe->bqhe", weights, v[:, :, kv_of])


def inputs(seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(ks[0], (B, T, H, E)), jax.random.normal(ks[1], (B, T, K, E)),
            jax.random.normal(ks[2], (B, T, K, E)))


def documents():
    """Two documents in the first sequence (split at 100), three in the second."""
    seg = np.zeros((B, T), np.int32)
    seg[0, 100:] = 1
    seg[1, 50:], seg[1, 180:] = 1, 2
    return seg


@pytest.mark.parametrize("impl", ["xla", "splash"])
@pytest.mark.parametrize("with_documents", [False, True])
def test_attention_equals_numpy(impl, with_documents):
    q, k, v = inputs()
    seg = documents() if with_documents else None
    got = causal_attention(q, k, v, None if seg is None else jnp.asarray(seg), impl=impl, interpret=True)
    np.testing.assert_allclose(np.asarray(got), numpy_attention(q, k, v, seg), atol=2e-5)


@pytest.mark.parametrize("block", [64, 96, 256])
@pytest.mark.parametrize("with_documents", [False, True])
def test_query_blocks_equal_numpy_and_jax(block, with_documents):
    """The "xla" attention in blocks of queries (4 blocks; 3 with a short last one; one) equals the
    NumPy reference, and its gradients equal those of `jax.nn.dot_product_attention`."""
    q, k, v = inputs(3)
    seg = jnp.asarray(documents()) if with_documents else None
    got = _query_blocks(q, k, v, seg, block=block)
    np.testing.assert_allclose(np.asarray(got), numpy_attention(q, k, v, documents() if with_documents else None),
                               atol=2e-5)
    probe = jax.random.normal(jax.random.key(4), (B, T, H, E))
    mask = None if seg is None else (seg[:, :, None] == seg[:, None, :])[:, None]
    want = jax.grad(lambda *a: jnp.sum(jax.nn.dot_product_attention(*a, mask=mask, is_causal=True) * probe),
                    argnums=(0, 1, 2))(q, k, v)
    got = jax.grad(lambda *a: jnp.sum(_query_blocks(*a, seg, block=block) * probe), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        assert float(jnp.max(jnp.abs(w))) > 1e-2  # a real gradient
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=5e-5)


def test_query_blocks_skip_the_masked_triangle():
    """Blocks of T/4 queries compute 5/8 of the T x T scores: the compiled gradient has fewer FLOPs
    than one block's, by at least the skipped 3/8 of the score and weighted-value products."""
    q, k, v = inputs()

    def flops(block):
        grad = jax.jit(jax.grad(lambda *a: jnp.sum(_query_blocks(*a, None, block=block)), argnums=(0, 1, 2)))
        cost = grad.lower(q, k, v).compile().cost_analysis()
        return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])

    products = 2 * B * H * T * T * E * 2 * 3  # q k^T and p v, forward and two products each backward
    assert flops(T) - flops(T // 4) >= 3 / 8 * products


@pytest.mark.parametrize("with_documents", [False, True])
def test_splash_gradients_equal_xla(with_documents):
    q, k, v = inputs(1)
    seg = jnp.asarray(documents()) if with_documents else None
    probe = jax.random.normal(jax.random.key(2), (B, T, H, E))

    def loss(impl):
        return lambda q, k, v: jnp.sum(causal_attention(q, k, v, seg, impl=impl, interpret=True) * probe)

    want = jax.grad(loss("xla"), argnums=(0, 1, 2))(q, k, v)
    got = jax.grad(loss("splash"), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        assert float(jnp.max(jnp.abs(w))) > 1e-2  # a real gradient
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=5e-5)


def test_model_with_splash_attention_equals_xla():
    """A 2-layer delta model: the loss and every parameter's gradient agree between attention impls."""
    tokens = jax.random.randint(jax.random.key(3), (2, 129), 0, 97)

    def grads(attention):
        cfg = model_config(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=64,
                           dtype="float32", loss_chunk=0, attention=attention,
                           residual=dict(mode="delta", block_layers=1, interpret=True))
        model = Transformer(cfg)
        params = model.init(jax.random.key(0), tokens[:, :-1])

        def loss(p):
            logits = model.apply(p, tokens[:, :-1])
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))

        kernels = str(jax.make_jaxpr(loss)(params)).count("pallas_call")
        return jax.value_and_grad(loss)(params), kernels

    ((want_loss, want), xla_kernels), ((got_loss, got), splash_kernels) = grads("xla"), grads("splash")
    assert xla_kernels == 0 and splash_kernels > 0  # the splash kernel is in the program
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-6)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-6)


def test_splash_block_needs_a_multiple_of_128():
    assert splash_block(128) == 128 and splash_block(2048) == 512
    for bad in (100, 640 + 128):
        with pytest.raises(ValueError, match="multiple of 128"):
            splash_block(bad)


@pytest.mark.parametrize("impl,platform,message", [
    ("cudnn", "cpu", "runs on NVIDIA GPUs"), ("cudnn", "tpu", "runs on NVIDIA GPUs"),
    ("splash", "cpu", "runs on TPUs"), ("splash", "gpu", "runs on TPUs"),
])
def test_attention_refuses_other_platforms(impl, platform, message):
    with pytest.raises(ValueError, match=message):
        check_attention(impl, platform, 2048)
    with pytest.raises(ValueError, match=message):  # the platform is named first, not the length
        check_attention(impl, platform, 100)
    check_attention("xla", platform, 100)  # xla runs everywhere, any length


KERNELS_BY_PLATFORM = {  # what each named kernel compiles for (interpret=False)
    ("attention", "cudnn"): {"gpu", "cuda"}, ("attention", "splash"): {"tpu"},
    ("residual.impl", "pallas_tpu"): {"tpu"}, ("residual.impl", "pallas_gpu"): {"gpu", "cuda"},
}


@pytest.mark.parametrize("field,impl", KERNELS_BY_PLATFORM)
@pytest.mark.parametrize("platform", ["cpu", "gpu", "cuda", "tpu"])
def test_a_kernel_named_for_another_platform_is_one_line(field, impl, platform):
    """config.model.attention and config.model.residual.impl against the devices' platform, as the trainer
    and deltares.aot check them before compiling (deltares.nn.config.check_platform): a kernel that cannot
    lower there is one line naming the field, the kernel and the platform; with residual.interpret=True
    (the Pallas interpreter) the Pallas kernels run anywhere; "auto", "pallas" and "xla" always pass."""
    from deltares.nn.config import check_platform, model_config

    cfg = model_config(dtype="bfloat16", head_dim=64, **({"attention": impl} if field == "attention" else
                                                            {"residual": {"impl": impl}}))
    if platform in KERNELS_BY_PLATFORM[field, impl]:
        check_platform(cfg, platform, 1024)
    else:
        with pytest.raises(ValueError) as err:
            check_platform(cfg, platform, 1024)
        message = str(err.value)
        assert f"config.model.{field}" in message and impl in message and "\n" not in message, message
        assert platform in message or (platform == "cuda" and "gpu" in message), message
    if impl != "cudnn":
        check_platform(model_config(attention=impl if field == "attention" else "auto",
                                    residual=dict(impl=impl if field != "attention" else "auto", interpret=True)),
                       platform, 1024)
    for other in ("auto", "pallas", "xla"):
        if field == "residual.impl" or other != "pallas":
            check_platform(model_config(**({"attention": other} if field == "attention" else
                                           {"residual": {"impl": other}})), platform, 100)


@pytest.mark.parametrize("dtype,head_dim,message", [
    ("float32", 64, "computes in bfloat16 or float16"), ("bfloat16", 12, "multiple of 8"),
    ("float16", 264, "at most 256"),
])
def test_cudnn_names_the_dtype_or_head_width_it_cannot_take(dtype, head_dim, message):
    """On a GPU, cuDNN's attention at a dtype or head width it refuses: the cause, not a missing GPU."""
    with pytest.raises(ValueError, match=message):
        check_attention("cudnn", "gpu", 1024, dtype=jnp.dtype(dtype), head_dim=head_dim)
    check_attention("cudnn", "gpu", 1024, dtype=jnp.bfloat16, head_dim=128)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN runs on NVIDIA GPUs (JAX_PLATFORMS=cuda there)")
@pytest.mark.parametrize("with_documents", [False, True])
def test_cudnn_equals_numpy_and_xla_on_a_gpu(with_documents):
    """cuDNN's flash attention (bfloat16, as the model runs it) against the float64 NumPy reference,
    and its gradients against those of the "xla" attention in float32 on the same bfloat16 inputs."""
    q, k, v = (x.astype(jnp.bfloat16) for x in inputs(5))
    seg = documents() if with_documents else None
    seg_j = None if seg is None else jnp.asarray(seg)
    got = causal_attention(q, k, v, seg_j, impl="cudnn")
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), numpy_attention(q, k, v, seg), atol=2e-2)
    probe = jax.random.normal(jax.random.key(6), (B, T, H, E))

    def loss(impl, dtype):
        return lambda *a: jnp.sum(causal_attention(*(x.astype(dtype) for x in a), seg_j, impl=impl)
                                  .astype(jnp.float32) * probe)

    want = jax.grad(loss("xla", jnp.float32), argnums=(0, 1, 2))(q, k, v)
    got = jax.grad(loss("cudnn", jnp.bfloat16), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        scale = float(jnp.max(jnp.abs(w)))
        assert scale > 1e-2  # a real gradient
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w), atol=2e-2 * scale)


def test_auto_means_cudnn_on_gpus_in_half_precision():
    assert auto_is_cudnn("gpu", jnp.bfloat16, 64) and auto_is_cudnn("cuda", jnp.float16, 128)
    assert not auto_is_cudnn("gpu", jnp.float32, 64)  # cuDNN's flash attention: 16-bit inputs only
    assert not auto_is_cudnn("gpu", jnp.bfloat16, 136) and not auto_is_cudnn("gpu", jnp.bfloat16, 60)
    assert not auto_is_cudnn("cpu", jnp.bfloat16, 64) and not auto_is_cudnn("tpu", jnp.bfloat16, 64)


def test_auto_tries_cudnn_for_a_gpu_and_falls_back_to_xla(monkeypatch):
    """"auto" off a GPU is "xla"; for a GPU target in bfloat16 it calls cuDNN, and where cuDNN is not
    found (here: a CPU machine) it computes the "xla" attention instead of failing."""
    q, k, v = (x.astype(jnp.bfloat16) for x in inputs())
    want = _query_blocks(q, k, v, None)
    np.testing.assert_array_equal(np.asarray(causal_attention(q, k, v, impl="auto"), np.float32),
                                  np.asarray(want, np.float32))
    calls = []

    def cudnn(*args):
        calls.append(args)
        return attention.jax.nn.dot_product_attention(*args[:3], is_causal=True, implementation="cudnn")

    monkeypatch.setattr(attention, "_cudnn", cudnn)
    monkeypatch.setattr(attention, "target_platform", lambda: "gpu")
    got = causal_attention(q, k, v, impl="auto")
    assert len(calls) == 1
    if jax.default_backend() != "gpu":  # cuDNN not found: the xla attention
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    causal_attention(q.astype(jnp.float32), k, v, impl="auto")
    assert len(calls) == 1  # float32: xla without trying cuDNN


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN runs on NVIDIA GPUs (JAX_PLATFORMS=cuda there)")
def test_auto_compiles_cudnn_on_a_gpu():
    q, k, v = (x.astype(jnp.bfloat16) for x in inputs())
    hlo = jax.jit(lambda *a: causal_attention(*a, impl="auto")).lower(q, k, v).as_text()
    assert "cudnn" in hlo


def test_cudnn_without_a_gpu_is_one_clear_error():
    q, k, v = inputs()
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is present: cuDNN may run")
    with pytest.raises(ValueError, match=r"'cudnn' cannot run here \(.+\): it needs an NVIDIA GPU with cuDNN") as err:
        causal_attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), impl="cudnn")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="'cudnn' cannot run here"):
        causal_attention(q, k, v, impl="cudnn")  # float32, off a GPU
