"""Benchmark of depth routing: the XLA reference against the Pallas kernel and the memory floor.

    python -m kernels_pallas.depth_route.bench                     # all shapes, bfloat16
    python -m kernels_pallas.depth_route.bench --shapes 1044m_s73 --dtype float32 --iters 50
    python -m kernels_pallas.depth_route.bench --shapes 1044m_s73 --queries 8   # two-phase's phase one

Per shape, a markdown table: forward and forward+backward times of the XLA reference and of
the kernel, and the floor set by the bytes that must move at the bandwidth of a large device
copy measured at the start. Forward: read S sources and the residual, write the output;
backward: read S sources and dout, write S source gradients (the residual's is dout itself).
On a CPU the token count is scaled down (to --cpu_tokens) and the kernel is skipped, since
interpret mode is no speed measurement, unless --implementation forces it (then in interpret mode).
With --queries K the routing timed is phase one of two-phase routing (`route_prefix`: K queries
over the S sources; forward writes K float32 outputs, backward reads dout and writes S gradients).

Then the train step (deltares.bench: forward, backward and AdamW update) of the 1044M model
(experiments/s1044m.py, bf16, remat full) for baseline, delta_block and delta, with routing by
XLA, by the kernel, and by the kernel two-phase (`--train_group_layers`), relative to baseline; `--train_layers` fewer layers when memory is short
(0: none).
Skipped on a CPU unless --train_step is given.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.depth_route import api, reference

SHAPES = {  # name: (S, tokens B*T, D)
    "1044m_s5": (5, 16384, 1280),  # 1044M model, block modes (few sources)
    "1044m_s73": (73, 16384, 1280),  # 1044M model, per-sublayer modes: 2L + 1 sources
    "7b6_s5": (5, 8192, 4096),  # 7.6B model, block modes
}


def timeit(fn, args, iters: int) -> float:
    """Median seconds of one call (after a warm-up call that compiles)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(nbytes: int, iters: int) -> float:
    """Bytes per second of a device copy (read + write) of an nbytes array."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    seconds = timeit(jax.jit(lambda x: x * 1.0), (x,), iters)  # not elided: the input is not donated
    return 2 * x.nbytes / seconds


def make_args(S, N, D, dtype, seed=0):
    k = jax.random.split(jax.random.key(seed), 5)
    sources = jax.random.normal(k[0], (S, 1, N, D), dtype)
    query = jax.random.normal(k[1], (D,), jnp.float32) / np.sqrt(D)
    gain = jnp.ones((D,), jnp.float32)
    residual = jax.random.normal(k[2], (1, N, D), dtype)
    return sources, jnp.ones((S,), bool), query, gain, residual


def programs(route):
    """Jitted forward and forward+backward (grads of sources, query, gain, residual)."""
    fwd = jax.jit(route)

    def loss(sources, valid, query, gain, residual):
        return jnp.sum(route(sources, valid, query, gain, residual).astype(jnp.float32))

    return fwd, jax.jit(jax.grad(loss, argnums=(0, 2, 3, 4)))


def prefix_programs(route, K):
    """`programs` for phase one: K queries (and gains) [K, D] over the sources, no residual."""

    def prefix(sources, valid, query, gain, residual):
        del residual
        out, lse = route(sources, jnp.ones((K, sources.shape[0]), bool), jnp.tile(query, (K, 1)),
                         jnp.tile(gain, (K, 1)))
        return out.sum(axis=0) + lse.sum(axis=0)[..., None]

    return programs(prefix)


def bench_shape(name, S, N, D, dtype, impl, interpret, iters, bandwidth, note="", queries=0):
    itemsize = jnp.dtype(dtype).itemsize
    if queries:  # phase one: read S, write K float32 outputs; backward: read S and dout, write S
        fwd_bytes = S * N * D * itemsize + 4 * queries * N * D
        bwd_bytes = 2 * S * N * D * itemsize + 4 * queries * N * D
    else:
        fwd_bytes = (S + 2) * N * D * itemsize
        bwd_bytes = (2 * S + 1) * N * D * itemsize
    args = make_args(S, N, D, dtype)
    rows = [("floor (bytes / copy bandwidth)", fwd_bytes / bandwidth, (fwd_bytes + bwd_bytes) / bandwidth)]

    def build(implementation):
        if queries:
            return prefix_programs(functools.partial(api.route_prefix, implementation=implementation,
                                                     interpret=interpret), queries)
        if implementation == "xla":
            return programs(lambda *a: reference.depth_route(*a))
        if implementation == api.MOSAIC_GPU:  # its layout: S separate sources (`kernel_args`), a static mask
            return programs(lambda s, v, *a: api.depth_route(s, np.ones(S, bool), *a, implementation=implementation,
                                                             interpret=interpret))
        return programs(lambda *a: api.depth_route(*a, implementation=implementation, interpret=interpret))

    fwd, both = build("xla")
    rows.append(("xla reference", timeit(fwd, args, iters), timeit(both, args, iters)))
    if impl is None:
        rows.append((f"kernel: {note}", None, None))
    else:
        fwd, both = build(impl)
        label = f"{impl}{' (interpret mode)' if interpret else ''}"
        kernel_args = (tuple(args[0]), *args[1:]) if impl == api.MOSAIC_GPU and not queries else args
        rows.append((label, timeit(fwd, kernel_args, iters), timeit(both, kernel_args, iters)))
    floor_fwd, floor_both = rows[0][1], rows[0][2]
    what = f"phase one, K={queries} queries, " if queries else ""
    print(f"\n### {name}: {what}S={S}, B*T={N}, D={D}, {jnp.dtype(dtype).name}\n")
    print(f"forward moves {fwd_bytes / 1e6:.1f} MB, backward {bwd_bytes / 1e6:.1f} MB\n")
    print("| implementation | forward ms | x floor | fwd+bwd ms | x floor |")
    print("|---|---:|---:|---:|---:|")
    for label, t_fwd, t_both in rows:
        if t_fwd is None:
            print(f"| {label} | - | - | - | - |")
            continue
        print(f"| {label} | {1e3 * t_fwd:.3f} | {t_fwd / floor_fwd:.2f} | {1e3 * t_both:.3f} | "
              f"{t_both / floor_both:.2f} |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--iters", type=int, default=None, help="timed calls per program (default 20, 3 on CPU)")
    parser.add_argument("--implementation", default=None,
                        choices=("pallas_tpu", "pallas_gpu", "pallas_mosaic_gpu"),
                        help="kernel to time (default: the platform's; on CPU none, unless given here)")
    parser.add_argument("--cpu_tokens", type=int, default=1024, help="B*T used on a CPU (default 1024)")
    parser.add_argument("--small", action="store_true", help="use --cpu_tokens on any platform")
    parser.add_argument("--queries", type=int, default=0,
                        help="time phase one of two-phase routing with this many queries (default 0: depth_route)")
    parser.add_argument("--train_step", action="store_true", help="also time the train step on a CPU")
    parser.add_argument("--train_layers", type=int, default=36,
                        help="layers of the 1044M model in the train step (0: no train step)")
    parser.add_argument("--train_batch", type=int, default=8, help="sequences per train step")
    parser.add_argument("--train_seq", type=int, default=2048, help="tokens per sequence in the train step")
    parser.add_argument("--train_group_layers", type=int, default=4,
                        help="residual.group_layers of the two-phase kernel rows (default 4; 0 leaves them out)")
    args = parser.parse_args(argv)
    if args.queries < 0 or args.train_group_layers < 0 or args.train_layers < 0:
        parser.error("--queries, --train_layers and --train_group_layers must be non-negative")
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}; choose from {list(SHAPES)}")

    platform = api.target_platform()
    on_cpu = platform not in ("tpu", "gpu")
    iters = args.iters or (3 if on_cpu else 20)
    device = jax.devices()[0]
    bandwidth = copy_bandwidth((64 if on_cpu else 1024) * 2**20, iters)
    print(f"device: {device.device_kind} ({platform}); copy bandwidth {bandwidth / 1e9:.1f} GB/s; "
          f"median of {iters} calls")
    impl, interpret, note = args.implementation, False, ""
    if impl is None and not on_cpu:
        impl = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}[platform]
    elif impl is None:
        note = "skipped on CPU (interpret mode is no speed measurement; --implementation forces it)"
    elif api._PLATFORM_OF[impl] != platform:
        interpret = True
    scale = on_cpu or args.small
    if scale:
        print(f"B*T scaled down to {args.cpu_tokens} tokens per shape"
              f"{' on CPU' if on_cpu else ''} (--cpu_tokens); the floors scale with it")
    for name in args.shapes.split(","):
        S, N, D = SHAPES[name]
        bench_shape(name, S, args.cpu_tokens if scale else N, D, jnp.dtype(args.dtype), impl, interpret, iters,
                    bandwidth, note, args.queries)
    if on_cpu and not args.train_step:
        print("\ntrain step: skipped on CPU (--train_step runs it, with --train_layers/--train_batch/--train_seq)")
        return
    if args.train_layers == 0:
        print("\ntrain step: skipped (--train_layers 0)")
        return
    train_step_table(args.train_layers, args.train_batch, args.train_seq, impl if impl else "pallas", interpret,
                     args.train_group_layers)


def train_step_table(layers: int, batch: int, seq_len: int, impl: str, interpret: bool, group_layers: int = 4) -> None:
    """Train-step time of baseline, delta_block and delta at 1044M, routing by XLA, by the kernel, and by
    the kernel two-phase in groups of up to `group_layers` layers (0: not timed)."""
    import importlib.util  # noqa: PLC0415
    import os  # noqa: PLC0415

    from deltares import bench  # noqa: PLC0415

    path = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "s1044m.py")
    spec = importlib.util.spec_from_file_location("s1044m", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config("delta_block")
    cfg.model.update(n_layers=layers, remat="full", dtype="bfloat16")
    cfg.model.residual.block_layers = min(cfg.model.residual.block_layers, layers)
    print(f"\ntrain step, 1044M with {layers} layers, batch {batch} x {seq_len}, bf16, remat full "
          f"(median of 3 rounds x 3 steps):")
    base_ms = None
    print("| mode | routing | step ms | vs baseline |\n|---|---|---|---|")
    variants = [("xla", 0), (impl, 0)] + ([(impl, group_layers)] if group_layers else [])
    for routing_impl, group in variants:
        cfg.model.residual.update(impl=routing_impl, interpret=interpret and routing_impl != "xla", group_layers=group)
        modes = ["baseline", "delta_block", "delta"] if base_ms is None else ["delta_block", "delta"]
        results = bench.benchmark(cfg, modes, batch, seq_len, rounds=3, steps=3)
        label = f"{routing_impl}, two-phase (group_layers={group})" if group else routing_impl
        for mode, r in results.items():
            ms = statistics.median(r.step_s) * 1e3
            base_ms = ms if mode == "baseline" else base_ms
            print(f"| {mode} | {'-' if mode == 'baseline' else label} | {ms:.1f} | {ms / base_ms:.3f}x |")


if __name__ == "__main__":
    from deltares import command_line

    command_line.quiet_libtpu_off_tpu()  # a command: libtpu quiet on a machine without a TPU (see deltares.command_line)
    main()
