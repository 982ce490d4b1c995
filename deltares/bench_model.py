"""Forward+backward time per step of every residual mode, relative to baseline.

    python -m deltares.bench_model --config experiments/tiny.py [--batch 8 --seq_len 256]

Modes are timed in interleaved rounds (all modes once per round) so that slow
drift of a shared machine hits every mode alike; the median step is reported.
"""

from __future__ import annotations

import statistics
import time

import jax
from absl import app, flags
from ml_collections import config_flags

from deltares.config import MODES
from deltares.losses import lm_loss
from deltares.model import Transformer


def make_step(model_cfg, tokens_BT):
    """A jitted forward+backward step of `model_cfg` and its initial parameters."""
    model = Transformer(model_cfg)
    params = jax.jit(model.init)(jax.random.key(0), tokens_BT[:, :-1])["params"]

    @jax.jit
    def step(params, tokens_BT):
        def loss_fn(p):
            return lm_loss(model.apply({"params": p}, tokens_BT[:, :-1]), tokens_BT[:, 1:])

        return jax.value_and_grad(loss_fn)(params)

    return step, params


def time_modes(base_cfg, modes, batch, seq_len, rounds, steps):
    """{mode: (compile_s, [step seconds])}."""
    tokens_BT = jax.random.randint(jax.random.key(1), (batch, seq_len + 1), 0, base_cfg.vocab_size)
    compiled = {}
    for mode in modes:
        cfg = base_cfg.copy_and_resolve_references()
        cfg.residual.mode = mode
        step, params = make_step(cfg, tokens_BT)
        start = time.perf_counter()
        jax.block_until_ready(step(params, tokens_BT))
        compiled[mode] = (step, params, time.perf_counter() - start, [])
    for _ in range(rounds):
        for mode in modes:
            step, params, _, times = compiled[mode]
            for _ in range(steps):
                start = time.perf_counter()
                jax.block_until_ready(step(params, tokens_BT))
                times.append(time.perf_counter() - start)
    return {mode: (c[2], c[3]) for mode, c in compiled.items()}


def main(argv):
    del argv
    if _CONFIG.value is None:
        raise app.UsageError("--config is required, e.g. --config experiments/tiny.py")
    modes = ["baseline"] + [m for m in _MODES.value if m != "baseline"]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise app.UsageError(f"unknown modes {unknown}; allowed: {', '.join(MODES)}")
    cfg = _CONFIG.value.model
    print(
        f"{_CONFIG.value.get('scale', '?')}: d={cfg.d_model} L={cfg.n_layers} block_layers={cfg.residual.block_layers} "
        f"batch={_BATCH.value} seq={_SEQ.value} dtype={cfg.dtype} device={jax.devices()[0].device_kind}"
    )
    results = time_modes(cfg, modes, _BATCH.value, _SEQ.value, _ROUNDS.value, _STEPS.value)
    base = statistics.median(results["baseline"][1])
    tokens = _BATCH.value * _SEQ.value
    print("| mode | fwd+bwd ms/step | tokens/s | vs baseline | compile s |")
    print("|---|---|---|---|---|")
    for mode in modes:
        compile_s, times = results[mode]
        med = statistics.median(times)
        print(f"| {mode} | {med * 1e3:.1f} | {tokens / med:,.0f} | {med / base:.3f}x | {compile_s:.1f} |")


if __name__ == "__main__":  # flags only for the command line, so modules import side by side
    _CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment file, e.g. experiments/tiny.py.")
    _BATCH = flags.DEFINE_integer("batch", 8, "Sequences per step.")
    _SEQ = flags.DEFINE_integer("seq_len", 256, "Tokens per sequence.")
    _ROUNDS = flags.DEFINE_integer("rounds", 5, "Interleaved timing rounds.")
    _STEPS = flags.DEFINE_integer("steps", 4, "Timed steps per mode per round.")
    _MODES = flags.DEFINE_list("modes", list(MODES), "Modes to time (baseline is always included).")
    app.run(main)
