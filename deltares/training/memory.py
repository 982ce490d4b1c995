"""Peak memory figures for metrics.jsonl (`peak_bytes`) and the benchmark.

Where the backend keeps memory statistics (GPU, TPU) the figure is the devices'
high-water mark (`peak_bytes_in_use`, the largest over local devices; it covers
everything the process allocated so far). Elsewhere (the CPU) it is the compiled
step's footprint from XLA's `memory_analysis()`: arguments + outputs +
temporaries, less the output bytes that reuse donated argument buffers.
"""

from __future__ import annotations

import jax


def device_peak_bytes() -> int | None:
    """The largest memory high-water mark of the local devices, or None where the backend has none."""
    peaks = []
    for device in jax.local_devices():
        try:
            stats = device.memory_stats()
        except Exception:  # noqa: BLE001 - backends without memory statistics raise or return None
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


def compiled_bytes(compiled) -> dict | None:
    """{arguments, outputs, temporaries, aliased, code, total} bytes of a compiled executable, or None;
    total = arguments + outputs + temporaries - aliased (outputs written into donated arguments)."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    out = dict(
        arguments=int(m.argument_size_in_bytes),
        outputs=int(m.output_size_in_bytes),
        temporaries=int(m.temp_size_in_bytes),
        aliased=int(m.alias_size_in_bytes),
        code=int(m.generated_code_size_in_bytes),
    )
    out["total"] = out["arguments"] + out["outputs"] + out["temporaries"] - out["aliased"]
    return out


class PeakMemory:
    """`peak_bytes` of a training run: the device high-water mark when available, else the compiled
    footprint of `step` (a jitted function or `MeshStep`), lowered once with the arguments of the
    first call (the executable comes from the compilation cache)."""

    def __init__(self, step):
        self.step, self.compiled = step, None

    def __call__(self, *args) -> int | None:
        peak = device_peak_bytes()
        if peak is not None:
            return peak
        if self.compiled is None:
            figures = compiled_bytes(self.step.lower(*args).compile())
            self.compiled = figures["total"] if figures else -1
        return self.compiled if self.compiled >= 0 else None
