"""Config of a deltares routed Qwen3 (model_type `deltares_qwen3`): Qwen3's fields plus the residual scheme.

Written by `deltares.interop.hf.to_hf` into every routed export, next to modeling_deltares_qwen3.py;
self-contained (transformers only). The `residual_*` fields are deltares' `config.model.residual`.
"""

from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

MODES = ("baseline", "full_attnres", "block_attnres", "delta", "delta_block")


class DeltaResQwen3Config(Qwen3Config):
    """`residual_mode`: one of MODES; `residual_block_layers`: transformer layers per block (block modes);
    `residual_include_partial`: block modes also route over the running block's partial sum;
    `residual_gate`: x = h + gate * route(S) (additive modes); `residual_null_source`: a learned extra
    source in every softmax (additive modes)."""

    model_type = "deltares_qwen3"

    residual_mode: str = "delta_block"
    residual_block_layers: int = 4
    residual_include_partial: bool = True
    residual_gate: bool = False
    residual_null_source: bool = False

    def __post_init__(self, **kwargs):
        if self.residual_mode not in MODES:
            raise ValueError(f"residual_mode {self.residual_mode!r} is unknown; allowed: {', '.join(MODES)}")
        super().__post_init__(**kwargs)


__all__ = ["DeltaResQwen3Config"]
