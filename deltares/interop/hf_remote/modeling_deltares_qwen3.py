"""A deltares routed Qwen3 in PyTorch: Qwen3 with learned cross-layer depth routing.

Written by `deltares.interop.hf.to_hf` into every routed export (load it with
`AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`); self-contained
(torch and transformers only). It computes what deltares computes (docs/explanations/modes.md
in the deltares repository):

    route(S) = sum_i a_i s_i,   a = softmax_i(w . RMSNorm_g(s_i))     (w, g per sublayer)

| mode | sources S_j of sublayer j | input x_j | output before the final norm |
|---|---|---|---|
| full_attnres | [e, v_0 .. v_{j-1}] | route(S_j) | route([e, v_0 .. v_{2L-1}]) (final router) |
| block_attnres | [e, c_0 .. c_{n-1}] + [p_j] unless j opens block n | route(S_j) | route([e, c_0 .. c_{N-1}]) |
| delta | [e, v_0 .. v_{j-1}] | h_j + route(S_j) | h_2L |
| delta_block | as block_attnres | h_j + route(S_j) | h_2L |

    v_j = f_j(RMSNorm(x_j)),   h_{j+1} = h_j + v_j   (f_j: attention, then MLP, alternately)

e is the embedding, c_n the sum of the deltas of block n (`residual_block_layers` layers),
p_j the sum of block n's deltas before j. A sublayer with one source does not route
(additive modes: x_j = h_j). `residual_gate`: x_j = h_j + gate_j * route(S_j).
`residual_null_source`: one more learned source in every softmax. Routing is per token,
so decoding with a KV cache needs only Qwen3's attention caches.
"""

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

from .configuration_deltares_qwen3 import DeltaResQwen3Config

BLOCK_MODES = ("block_attnres", "delta_block")
REPLACEMENT_MODES = ("full_attnres", "block_attnres")


def depth_route(sources, query, gain, eps):
    """route(S) over `sources` [S, B, T, D] with pseudo-query `query` and key-norm gain `gain` [D]:
    keys, logits and softmax in float32; the output has the sources' dtype."""
    s = sources.float()
    keys = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * gain.float()
    weights = torch.softmax(keys @ query.float(), dim=0)  # [S, B, T]
    return (weights.unsqueeze(-1) * s).sum(0).to(sources.dtype)


class DepthSources:
    """The sources each sublayer routes over, kept as deltares keeps them.

    Per-sublayer modes: [e, v_0, v_1, ...]. Block modes: `done` = [e, c_0 .. c_{n-1}] and
    the running block's `partial` p (None until block n's first delta)."""

    def __init__(self, config, e):
        self.blocks = config.residual_mode in BLOCK_MODES
        self.block_layers = config.residual_block_layers
        self.include_partial = config.residual_include_partial
        self.n_layers = config.num_hidden_layers
        self.done = [e]
        self.partial = None
        self.j = 0  # the next sublayer

    def read(self):
        """S_j of the next sublayer."""
        if self.blocks and self.include_partial and self.partial is not None:
            return self.done + [self.partial]
        return list(self.done)

    def write(self, v):
        """Sublayer j's delta: a new source, or into the block's partial (closed at the block's end)."""
        if not self.blocks:
            self.done.append(v)
        else:
            self.partial = v if self.partial is None else self.partial + v
            layer = self.j // 2
            if self.j % 2 == 1 and ((layer + 1) % self.block_layers == 0 or layer + 1 == self.n_layers):
                self.done.append(self.partial)
                self.partial = None
        self.j += 1

    def final(self):
        """The final router's sources (Kimi modes): [e, v_0 .. v_{2L-1}] or [e, c_0 .. c_{N-1}]."""
        return list(self.done)


class DeltaResQwen3DecoderLayer(nn.Module):
    """Qwen3's attention and MLP, each with its router: `{attn,mlp}_res_proj` (w), `{attn,mlp}_res_norm`
    (g), and with the config's options `{attn,mlp}_res_gate` and `{attn,mlp}_null_source`."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.mode = config.residual_mode
        D = config.hidden_size
        self.self_attn = Qwen3Attention(config=config, layer_idx=layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(D, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(D, eps=config.rms_norm_eps)
        if self.mode == "baseline":
            return
        for sub in ("attn", "mlp"):
            setattr(self, f"{sub}_res_proj", nn.Linear(D, 1, bias=False))
            setattr(self, f"{sub}_res_norm", Qwen3RMSNorm(D, eps=config.rms_norm_eps))
            if config.residual_gate:
                setattr(self, f"{sub}_res_gate", nn.Parameter(torch.zeros(1)))
            if config.residual_null_source:
                setattr(self, f"{sub}_null_source", nn.Parameter(torch.zeros(D)))

    def sublayer_input(self, sub, h, sources):
        """x_j of sublayer `sub` ("attn" or "mlp") from the stream h_j and its sources S_j."""
        if self.mode == "baseline":
            return h
        null = getattr(self, f"{sub}_null_source", None)
        if self.mode not in REPLACEMENT_MODES and len(sources) == 1 and null is None:
            return h  # a single source does not route
        if null is not None:
            sources = sources + [null.to(h.dtype).expand_as(h)]
        proj, norm = getattr(self, f"{sub}_res_proj"), getattr(self, f"{sub}_res_norm")
        routed = depth_route(torch.stack(sources), proj.weight[0], norm.weight, norm.variance_epsilon)
        if self.mode in REPLACEMENT_MODES:
            return routed
        gate = getattr(self, f"{sub}_res_gate", None)
        return h + (routed if gate is None else gate.to(h.dtype) * routed)

    def attention(self, x, position_embeddings, attention_mask, cache, **kwargs):
        out, _ = self.self_attn(hidden_states=self.input_layernorm(x), position_embeddings=position_embeddings,
                                attention_mask=attention_mask, cache=cache, **kwargs)
        return out

    def feed_forward(self, x):
        return self.mlp(self.post_attention_layernorm(x))


class DeltaResQwen3PreTrainedModel(PreTrainedModel):
    config_class = DeltaResQwen3Config
    config: DeltaResQwen3Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["DeltaResQwen3DecoderLayer"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True

    def _init_weights(self, module):
        """Qwen3's initialisation; routing starts as deltares': w = 0, g = 1, gate = 0, null source = 0."""
        super()._init_weights(module)
        if isinstance(module, DeltaResQwen3DecoderLayer) and module.mode != "baseline":
            for sub in ("attn", "mlp"):
                init.zeros_(getattr(module, f"{sub}_res_proj").weight)
                for name in (f"{sub}_res_gate", f"{sub}_null_source"):
                    if getattr(module, name, None) is not None:
                        init.zeros_(getattr(module, name))
        if isinstance(module, DeltaResQwen3Model) and module.final_res_proj is not None:
            init.zeros_(module.final_res_proj.weight)


class DeltaResQwen3Model(DeltaResQwen3PreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        D = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, D, config.pad_token_id)
        self.layers = nn.ModuleList(
            [DeltaResQwen3DecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = Qwen3RMSNorm(D, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config=config)
        self.final_res_proj = self.final_res_norm = None
        if config.residual_mode in REPLACEMENT_MODES:
            self.final_res_proj = nn.Linear(D, 1, bias=False)
            self.final_res_norm = Qwen3RMSNorm(D, eps=config.rms_norm_eps)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                use_cache=None, **kwargs):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                                  cache=cache, position_ids=position_ids)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)

        h = inputs_embeds
        sources = DepthSources(self.config, inputs_embeds)
        for layer in self.layers:
            x = layer.sublayer_input("attn", h, sources.read())
            v = layer.attention(x, position_embeddings, mask, cache, **kwargs)
            h = h + v
            sources.write(v)
            x = layer.sublayer_input("mlp", h, sources.read())
            v = layer.feed_forward(x)
            h = h + v
            sources.write(v)
        if self.final_res_proj is not None:
            h = depth_route(torch.stack(sources.final()), self.final_res_proj.weight[0], self.final_res_norm.weight,
                            self.final_res_norm.variance_epsilon)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(h), cache=cache if use_cache else None)


class DeltaResQwen3ForCausalLM(DeltaResQwen3PreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.model = DeltaResQwen3Model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        logits = self.lm_head(slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=outputs.cache)


__all__ = ["DeltaResQwen3ForCausalLM", "DeltaResQwen3Model", "DeltaResQwen3PreTrainedModel"]
