"""Causal self-attention of the training step, by one of three implementations of the same math
(`config.model.attention`), or "auto" (the default): "cudnn" where it runs (NVIDIA GPUs, bfloat16 or
float16, a head width cuDNN's flash attention takes, cuDNN present), else "xla". On an H200 the
220M train step took 72 ms with "cudnn" against 158 ms with "xla" (docs/explanations/performance.md).

- "xla": plain JAX lowered by XLA (every platform), in blocks of queries: block i reads the keys
  up to its own end only, so the masked upper triangle of whole blocks is never computed (with n
  blocks, (n + 1) / 2n of the T x T scores; 5/8 at 2048 tokens in blocks of 512). Scores and
  softmax in float32 as `jax.nn.dot_product_attention`; the unnormalised weights multiply the values
  and the output is divided by their sum (one pass over the scores fewer);
- "cudnn": `jax.nn.dot_product_attention` with cuDNN's fused flash attention (NVIDIA GPUs);
- "splash": the TPU splash-attention Pallas kernel of `jax.experimental.pallas.ops.tpu`, one
  multi-query kernel per key/value head (grouped-query attention without repeating K and V),
  inside `jax.shard_map` under a mesh (sequences and key/value heads split as the logical rules
  say, tokens whole). `interpret=True` runs it with the Pallas interpreter (CPU tests).

Generation (a key/value cache) always uses "xla".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from deltares.nn.axes import shard_spec
from kernels_pallas.depth_route.api import target_platform

ATTENTION_IMPLS = ("auto", "xla", "cudnn", "splash")
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
CUDNN_MAX_HEAD_DIM = 128  # cuDNN's flash attention: head width a multiple of 8, at most 128 (256 from Hopper on)
CUDNN_HOPPER_HEAD_DIM = 256
XLA_BLOCK = 512  # queries per block of the "xla" attention
SPLASH_BLOCK = 512  # tokens per splash block (queries and keys); smaller sequences use one block
SPLASH_MIN_BLOCK = 128  # a splash block is a multiple of the TPU's 128 lanes

Q_AXES = ("batch", "length", "heads", "head_dim")
KV_AXES = ("batch", "length", "kv", "head_dim")


def causal_attention(q_BTHE, k_BTKE, v_BTKE, segments_BT=None, *, impl: str = "xla", interpret: bool = False):
    """softmax(q k^T / sqrt(E) + causal mask) v for grouped-query heads ([B, T, H, E] queries, [B, T,
    K, E] keys and values, K dividing H); with `segments_BT` a token sees only earlier tokens of
    its own document (equal ids)."""
    if impl == "auto":
        return _auto(q_BTHE, k_BTKE, v_BTKE, segments_BT)
    if impl == "splash":
        return _splash(q_BTHE, k_BTKE, v_BTKE, segments_BT, interpret)
    if impl == "xla":
        return _query_blocks(q_BTHE, k_BTKE, v_BTKE, segments_BT)
    if impl != "cudnn":
        raise ValueError(f"attention implementation must be one of {ATTENTION_IMPLS}, got {impl!r}")
    try:
        return _cudnn(q_BTHE, k_BTKE, v_BTKE, segments_BT)
    except (RuntimeError, ValueError, NotImplementedError) as e:  # jax's: no cuDNN, a dtype or shape it refuses
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"config.model.attention 'cudnn' cannot run here ({reason}): it needs an NVIDIA GPU with "
                         "cuDNN, bfloat16 or float16 and a head width cuDNN takes; use 'auto' (cudnn only where it "
                         "runs) or 'xla'") from None


def auto_is_cudnn(platform: str, dtype, head_dim: int) -> bool:
    """Whether "auto" means "cudnn" for devices of `platform` at compute `dtype` and `head_dim` (given cuDNN)."""
    return (platform in ("gpu", "cuda") and any(jnp.dtype(dtype) == d for d in CUDNN_DTYPES)
            and head_dim % 8 == 0 and head_dim <= CUDNN_MAX_HEAD_DIM)


def _cudnn(q_BTHE, k_BTKE, v_BTKE, segments_BT):
    mask_B1TT = None if segments_BT is None else (segments_BT[:, :, None] == segments_BT[:, None, :])[:, None]
    return jax.nn.dot_product_attention(q_BTHE, k_BTKE, v_BTKE, mask=mask_B1TT, is_causal=True, implementation="cudnn")


def _auto(q_BTHE, k_BTKE, v_BTKE, segments_BT):
    """"cudnn" where `auto_is_cudnn` and cuDNN is found (the target platform: the surrounding mesh's,
    else the default backend's), else "xla"."""
    if auto_is_cudnn(target_platform(), q_BTHE.dtype, q_BTHE.shape[-1]):
        try:
            return _cudnn(q_BTHE, k_BTKE, v_BTKE, segments_BT)
        except RuntimeError:  # cuDNN not found (e.g. a GPU compiled for ahead of time from a CPU machine)
            pass
    return _query_blocks(q_BTHE, k_BTKE, v_BTKE, segments_BT)


def _query_blocks(q_BTHE, k_BTKE, v_BTKE, segments_BT, block: int = XLA_BLOCK):
    """The "xla" attention: causal grouped-query attention over blocks of `block` queries, each
    reading the keys up to its own last query (the last block may be shorter)."""
    B, T, H, E = q_BTHE.shape
    K = k_BTKE.shape[2]
    q_BTKGE = q_BTHE.reshape(B, T, K, H // K, E)
    scale, masked = jnp.float32(E ** -0.5), jnp.float32(-0.7 * jnp.finfo(jnp.float32).max)
    outs = []
    for start in range(0, T, block):
        end = min(start + block, T)
        k_BSKE, v_BSKE = k_BTKE[:, :end], v_BTKE[:, :end]
        s_BKGQS = jnp.einsum("bqkge,bske->bkgqs", q_BTKGE[:, start:end], k_BSKE,
                             preferred_element_type=jnp.float32) * scale
        allowed_QS = start + jnp.arange(end - start)[:, None] >= jnp.arange(end)[None, :]
        if segments_BT is None:
            allowed = allowed_QS[None, None, None]
        else:
            same_BQS = segments_BT[:, start:end, None] == segments_BT[:, None, :end]
            allowed = (allowed_QS & same_BQS)[:, None, None]
        s_BKGQS = jnp.where(allowed, s_BKGQS, masked)
        p_BKGQS = jnp.exp(s_BKGQS - jax.lax.stop_gradient(s_BKGQS.max(-1, keepdims=True)))
        sum_BQKG = p_BKGQS.sum(-1).transpose(0, 3, 1, 2)
        o_BQKGE = jnp.einsum("bkgqs,bske->bqkge", p_BKGQS.astype(v_BTKE.dtype), v_BSKE,
                             preferred_element_type=jnp.float32)
        outs.append((o_BQKGE / sum_BQKG[..., None]).astype(q_BTHE.dtype))
    return jnp.concatenate(outs, axis=1).reshape(B, T, H, E)


def check_attention(impl: str, platform: str, seq_len: int, interpret: bool = False, dtype=None,
                    head_dim: int | None = None) -> None:
    """ValueError when attention `impl` cannot run on devices of `platform` ("cpu", "gpu"/"cuda", "tpu")
    or over `seq_len` tokens (and, for "cudnn", at the compute `dtype` and `head_dim` where given)."""
    if impl == "cudnn" and platform not in ("gpu", "cuda"):
        raise ValueError(f"config.model.attention 'cudnn' runs on NVIDIA GPUs, these devices are {platform}; use 'xla'")
    if impl == "cudnn" and dtype is not None and not any(jnp.dtype(dtype) == d for d in CUDNN_DTYPES):
        raise ValueError(f"config.model.attention 'cudnn' computes in bfloat16 or float16 (cuDNN's flash attention), "
                         f"config.model.dtype is {jnp.dtype(dtype).name}; use 'auto' (cudnn only where it runs) or 'xla'")
    if impl == "cudnn" and head_dim is not None and (head_dim % 8 or head_dim > CUDNN_HOPPER_HEAD_DIM):
        raise ValueError(f"config.model.attention 'cudnn' takes a head width that is a multiple of 8, at most "
                         f"{CUDNN_HOPPER_HEAD_DIM} ({CUDNN_MAX_HEAD_DIM} before Hopper), config.model.head_dim is "
                         f"{head_dim}; use 'auto' or 'xla'")
    if impl == "splash":
        if platform != "tpu" and not interpret:
            raise ValueError(f"config.model.attention 'splash' runs on TPUs, these devices are {platform}; use 'xla' "
                             "(or config.model.residual.interpret=True: the Pallas interpreter, slow)")
        splash_block(seq_len)


def splash_block(T: int) -> int:
    """The splash block for `T` tokens; ValueError when no block fits."""
    block = min(SPLASH_BLOCK, T)
    if T % block or block % SPLASH_MIN_BLOCK:
        raise ValueError(f"attention 'splash' needs a sequence length that is a multiple of {SPLASH_MIN_BLOCK} "
                         f"(and of {SPLASH_BLOCK} above it), got {T}; use attention 'xla'")
    return block


def _mqa_kernel(T: int, Q: int, interpret: bool):
    """The splash kernel of Q query heads sharing one key/value head over T tokens, causal. Built per
    trace (not cached): it holds its mask tables as arrays of the trace that made it."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel  # noqa: PLC0415
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks  # noqa: PLC0415

    b = splash_block(T)
    sizes = kernel.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                              block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
    mask = masks.MultiHeadMask([masks.CausalMask((T, T)) for _ in range(Q)])
    return kernel.make_splash_mqa_single_device(mask, block_sizes=sizes, interpret=interpret)


def _splash_local(q_BTHE, k_BTKE, v_BTKE, segments_BT, interpret: bool):
    """Splash attention on whole (one device's) arrays: a multi-query kernel per (sequence, kv head)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel  # noqa: PLC0415

    B, T, H, E = q_BTHE.shape
    K = k_BTKE.shape[2]
    Q = H // K
    mqa = _mqa_kernel(T, Q, interpret)
    q_BKQTE = (q_BTHE * E ** -0.5).astype(q_BTHE.dtype).reshape(B, T, K, Q, E).transpose(0, 2, 3, 1, 4)
    k_BKTE, v_BKTE = (x.transpose(0, 2, 1, 3) for x in (k_BTKE, v_BTKE))
    if segments_BT is None:
        out_BKQTE = jax.vmap(jax.vmap(mqa))(q_BKQTE, k_BKTE, v_BKTE)
    else:
        def one(q, k, v, seg):
            ids = kernel.SegmentIds(q=seg, kv=seg)
            return jax.vmap(lambda q, k, v: mqa(q, k, v, segment_ids=ids))(q, k, v)

        out_BKQTE = jax.vmap(one)(q_BKQTE, k_BKTE, v_BKTE, segments_BT.astype(jnp.int32))
    return out_BKQTE.transpose(0, 3, 1, 2, 4).reshape(B, T, H, E)


def _splash(q_BTHE, k_BTKE, v_BTKE, segments_BT, interpret: bool):
    """`_splash_local` inside `jax.shard_map` under a mesh of several devices: sequences split over the
    batch's mesh axes and key/value heads (with their query heads) over the heads' axes where both
    divide evenly; tokens and head width whole."""
    splash_block(q_BTHE.shape[1])
    local = functools.partial(_splash_local, interpret=interpret)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return local(q_BTHE, k_BTKE, v_BTKE, segments_BT)
    P = jax.sharding.PartitionSpec
    q_spec, kv_spec = shard_spec(mesh, Q_AXES, q_BTHE.shape), shard_spec(mesh, KV_AXES, k_BTKE.shape)
    # query heads split only with their key/value heads (both divisible), so that a device holds whole groups
    heads = q_spec[2] if q_spec[2] == kv_spec[2] else None
    batch = q_spec[0]
    q_spec, kv_spec = P(batch, None, heads, None), P(batch, None, heads, None)
    args, specs = (q_BTHE, k_BTKE, v_BTKE), (q_spec, kv_spec, kv_spec)
    if segments_BT is not None:
        args, specs = args + (segments_BT,), specs + (P(batch, None),)
    fn = (lambda q, k, v, s=None: local(q, k, v, s))
    # check_vma off: the kernel's outputs declare no varying mesh axes (jax 0.10's splash), which the check rejects
    return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=q_spec, check_vma=False)(*args)


__all__ = ["ATTENTION_IMPLS", "auto_is_cudnn", "causal_attention", "check_attention", "splash_block"]
