"""One decoder layer of every family: pre-norm attention (GQA, or DeepSeek's MLA) and a
feed-forward block (the MLP, or the config's Mixture-of-Experts). It lives apart from
`model.layers` because MLA and MoE build on those layers."""

from __future__ import annotations

import flax.linen as nn

from jaxgen.model.config import ModelConfig
from jaxgen.model.layers import MLP, Attention, RMSNorm, constrain
from jaxgen.model.mla import MLAttention
from jaxgen.model.moe import MoE


class DecoderLayer(nn.Module):
    """Pre-norm block; the scan carry is (hidden [B, T, D], kv cache or None, layer index).
    `lora`: this layer's slice of a `model.lora.LoRABatch`, or None. `sparse`: the feed-forward
    is the config's Mixture-of-Experts block (`model.moe.MoE`, params under "moe"). `collect`:
    the layer's output is also its scan output (stacked [L, B, T, D] by the scan), for the
    callers that read hidden states between layers (`Transformer(return_hidden=(i, ...))`);
    off, the scan outputs nothing and its program is unchanged."""

    cfg: ModelConfig
    attn_impl: str | None = None
    sparse: bool = False
    collect: bool = False

    @nn.compact
    def __call__(self, carry, positions, md, lora=None):
        x, kv, layer = carry
        eps = self.cfg.rms_norm_eps
        attention = Attention
        if self.cfg.mla is not None:
            attention = MLAttention
        attn_out, kv = attention(self.cfg, self.attn_impl, name="attn")(
            RMSNorm(eps, name="attn_norm")(x), positions, kv, layer, md, lora
        )
        x = constrain(x + attn_out, "batch", "seq", "embed")
        h = RMSNorm(eps, name="mlp_norm")(x)
        if self.sparse:
            x = x + MoE(self.cfg, name="moe")(h)
        else:
            x = x + MLP(self.cfg, name="mlp")(h, lora)
        x = constrain(x, "batch", "seq", "embed")
        return (x, kv, layer + 1), (x if self.collect else None)
