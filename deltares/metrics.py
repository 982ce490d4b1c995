"""Training metrics: model FLOPs and MFU, and the writers for metrics.jsonl and TensorBoard.

MFU counts model FLOPs the standard way (PaLM, appendix B): per token,
6 x (matmul parameters) for the forward and backward passes, where the matmul
parameters are every layer weight plus the LM head (tied or not; the embedding
lookup is not a matmul), plus 12 x L x n_heads x head_dim x seq_len for the
attention scores and values (causal masking is not discounted). Routing and
norms are elementwise and not counted; recomputation under remat is not counted.
MFU = model FLOPs per second / (devices x peak FLOPs per device).
"""

from __future__ import annotations

import json
import math
import os

import jax

# Dense bf16 peak FLOPs per device (chip), by substring of `device_kind`.
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "TPU v4": 275e12,
    "TPU v5p": 459e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v6": 918e12,
}
NOMINAL_CPU_FLOPS_PER_CORE = 50e9  # float32, for a rough CPU MFU only


def matmul_params(model_cfg) -> int:
    D, L = model_cfg.d_model, model_cfg.n_layers
    attn = D * model_cfg.head_dim * (2 * model_cfg.n_heads + 2 * model_cfg.n_kv_heads)
    mlp = 3 * D * model_cfg.d_ff
    return L * (attn + mlp) + D * model_cfg.vocab_size


def model_flops_per_token(model_cfg, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), as in the module docstring."""
    attention = 12 * model_cfg.n_layers * model_cfg.n_heads * model_cfg.head_dim * seq_len
    return 6 * matmul_params(model_cfg) + attention


def peak_flops_per_device(override_tflops: float = 0.0) -> float:
    if override_tflops:
        return override_tflops * 1e12
    device = jax.devices()[0]
    if device.platform == "cpu":
        return NOMINAL_CPU_FLOPS_PER_CORE * (os.cpu_count() or 1)
    for key, flops in PEAK_FLOPS.items():
        if key.lower() in device.device_kind.lower():
            return flops
    return math.nan


class MetricsWriter:
    """Appends one JSON object per logged step to `<workdir>/metrics.jsonl` and mirrors
    scalars to TensorBoard event files in `<workdir>/tensorboard`."""

    def __init__(self, workdir: str, resume_step: int | None = None):
        self.path = os.path.join(workdir, "metrics.jsonl")
        if resume_step is not None:
            self._truncate_after(resume_step)
        from tensorboardX import SummaryWriter

        self.tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def _truncate_after(self, step: int) -> None:
        """Drops records logged after the checkpoint a run resumes from."""
        if not os.path.exists(self.path):
            return
        kept = []
        with open(self.path) as f:
            for line in f:
                try:
                    if json.loads(line)["step"] <= step:
                        kept.append(line)
                except (ValueError, KeyError):  # a line cut short by a crash
                    continue
        with open(self.path, "w") as f:
            f.writelines(kept)

    def write(self, step: int, record: dict) -> None:
        record = {"step": step, **record}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        for key, value in record.items():
            if isinstance(value, (int, float)) and key != "step" and math.isfinite(value):
                self.tb.add_scalar(key, value, step)
            elif isinstance(value, list) and value and isinstance(value[0], (int, float)):
                for i, v in enumerate(value):
                    self.tb.add_scalar(f"{key}/{i:03d}", v, step)
        self.tb.flush()

    def close(self) -> None:
        self.tb.close()
