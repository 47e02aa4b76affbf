"""Multi-head Latent Attention (DeepSeek-V2 §2.1, DeepSeek-V3), the attention of `ModelConfig`s
with `mla` set.

Per token, kv_a_proj_with_mqa makes one latent c (R = kv_lora_rank, RMS-normed) and one rope key
k_pe (Hr = qk_rope_head_dim) shared by all heads. kv_b_proj (W_UK | W_UV, [R, N, Hn + Hv]) lifts
c to each head's key part k_nope = c W_UK[n] and value v = c W_UV[n]; the head's key is
[k_nope, k_pe], its query [q_nope, q_pe] (from q_proj, or q_a_proj -> norm -> q_b_proj).

Two forms, equal in exact arithmetic:
  expanded  (prefill, no cached context): lift K/V for the step's tokens, then ordinary attention.
  absorbed  (decode, and chunks over cached context): scores are
              q_nope . (c W_UK[n]) + q_pe . k_pe = (q_nope W_UK[n]^T) . c + q_pe . k_pe,
            so W_UK is folded into the query (q_lat [N, R]) and attention runs over the cached
            entries [c, k_pe] themselves, one "KV head" of width R + Hr shared by all N heads
            (MQA); the output is a latent mixture, lifted by W_UV afterwards. K/V are never
            expanded, and the cache holds R + Hr values per token and layer.
The value of the absorbed form is the first R channels of the same cache entry (FlashMLA's
layout), so one array serves as both key and value; the Hr extra output channels are dropped.

Extra axis letter: R the latent (kv_lora_rank); the rope part is Hr, the value head dim Hv.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.cache.paged import RaggedMetadata
from jaxgen.model.config import ModelConfig, rope_attention_factor, rope_inv_freq, yarn_mscale
from jaxgen.model.layers import Linear, RMSNorm, _init, constrain, rotary
from jaxgen.pallas_kernels import dispatch

# transformers builds q_a_layernorm and kv_a_layernorm with their default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def interleaved_rotary(
    x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, attention_factor: float = 1.0
) -> jax.Array:
    """Rotary embedding on interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's checkpoints),
    written out de-interleaved ([rotated evens | rotated odds]) as transformers does; queries and
    keys get the same permutation, so their dot products are the interleaved rotation's.

    Args:
      x: [B, T, heads, H]; positions: i32[B, T]; inv_freq: f32[H/2]; attention_factor: yarn's
        factor on cos and sin.
    """
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, H/2]
    cos, sin = jnp.cos(freqs), jnp.sin(freqs)
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    cos, sin = cos.astype(x.dtype)[:, :, None, :], sin.astype(x.dtype)[:, :, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    return jnp.concatenate([even * cos - odd * sin, odd * cos + even * sin], axis=-1)


def softmax_scale(cfg: ModelConfig) -> float:
    """1 / sqrt(qk head dim), times yarn_mscale(factor, mscale_all_dim)^2 under yarn rope
    (DeepSeek-V2's softmax_scale)."""
    scale, rs = cfg.mla.qk_head_dim**-0.5, cfg.rope_scaling
    if rs.rope_type == "yarn" and rs.mscale_all_dim:
        scale *= yarn_mscale(rs.factor, rs.mscale_all_dim) ** 2
    return scale


def mla_cache_entry(latent_btr: jax.Array, k_pe_bth: jax.Array) -> jax.Array:
    """What the cache stores for each token: [B, T, R + Hr], the latent then the rope key."""
    return jnp.concatenate([latent_btr, k_pe_bth], axis=-1)


def absorbed_attention(
    q_lat_btnr, q_pe_btnh, entries_bsc, *, kv_lens, q_offsets, sm_scale, impl=None
) -> jax.Array:
    """Attention of the absorbed queries over cached entries (no K/V expansion).

    Args:
      q_lat_btnr: [B, T, N, R] queries with W_UK folded in; q_pe_btnh: [B, T, N, Hr] roped.
      entries_bsc: [B, S, R + Hr] cached [latent | rope key] per token.
      kv_lens: i32[B] valid entries; q_offsets: i32[B] position of each row's first query.
    Returns:
      [B, T, N, R]: each head's softmax-weighted mixture of latents.
    """
    r = q_lat_btnr.shape[-1]
    q = jnp.concatenate([q_lat_btnr, q_pe_btnh.astype(q_lat_btnr.dtype)], axis=-1)
    kv = entries_bsc[:, :, None, :].astype(q.dtype)  # one KV head: MQA over the latent
    out = dispatch.attention(
        q, kv, kv, kv_lens=kv_lens, q_offsets=q_offsets, sm_scale=sm_scale, impl=impl
    )
    return out[..., :r]


def expanded_attention(
    q_nope, q_pe, latent_bsr, k_pe_bsh, w_up_rnh, *, kv_lens, sm_scale, impl=None
) -> jax.Array:
    """Ordinary causal attention with K/V lifted from the latents of the step's own tokens.

    Args:
      q_nope: [B, T, N, Hn]; q_pe: [B, T, N, Hr]; latent_bsr: [B, S, R]; k_pe_bsh: [B, S, Hr];
      w_up_rnh: kv_b_proj as [R, N, Hn + Hv]; kv_lens: i32[B].
    Returns:
      [B, T, N, Hv].
    """
    hn = q_nope.shape[-1]
    kv_up = jnp.einsum("BSR,RNH->BSNH", latent_bsr, w_up_rnh.astype(latent_bsr.dtype))
    k_nope, v = kv_up[..., :hn], kv_up[..., hn:]
    b, s, n, _ = k_nope.shape
    k_pe = jnp.broadcast_to(k_pe_bsh[:, :, None, :], (b, s, n, k_pe_bsh.shape[-1]))
    q = jnp.concatenate([q_nope, q_pe], axis=-1)
    k = jnp.concatenate([k_nope, k_pe.astype(k_nope.dtype)], axis=-1)
    # The attention kernels take one head dim for q, k and v: pad the narrower side with zeros
    # (zero channels add nothing to the scores, and padded value channels are dropped).
    hv, hqk = v.shape[-1], q.shape[-1]
    width = max(hv, hqk)
    q, k = (jnp.pad(a, ((0, 0),) * 3 + ((0, width - hqk),)) for a in (q, k))
    v = jnp.pad(v, ((0, 0),) * 3 + ((0, width - hv),))
    out = dispatch.attention(q, k, v, kv_lens=kv_lens, sm_scale=sm_scale, impl=impl)
    return out[..., :hv]


def ragged_mla_attention(
    kv, layer, q_nope, q_pe, latent, k_pe, w_up_rnh, md: RaggedMetadata, *, sm_scale, impl=None
) -> jax.Array:
    """Attention of the engine's packed step ([decode | verify rows | prefill rows] in one row of
    N tokens, see `cache.paged.RaggedMetadata`) over a `cache.PagedMLACache` whose pages already
    hold the step's entries. Decode and verify tokens, and prefill chunks over cached context,
    attend absorbed over the latent pages in place (`dispatch.paged_mla_attention`: the Pallas
    MLA kernel on GPU); chunks without cached context attend expanded over their own tokens.

    Args:
      q_nope: [1, N, heads, Hn]; q_pe: [1, N, heads, Hr] roped; latent: [1, N, R];
      k_pe: [1, N, Hr] roped; w_up_rnh: kv_b_proj as [R, heads, Hn + Hv].
    Returns:
      [1, N, heads, Hv] (zeros for padding tokens past the prefill rows).
    """
    hn, r = q_nope.shape[-1], latent.shape[-1]
    w_uk, w_uv = w_up_rnh[..., :hn], w_up_rnh[..., hn:]
    heads, hv = w_uv.shape[1:]
    q_nope, q_pe, latent, k_pe = q_nope[0], q_pe[0], latent[0], k_pe[0]

    def absorbed(start, rows, length, tables, seq_lens):
        """Rows of `length` tokens from packed token `start`, absorbed over their pages."""
        end = start + rows * length
        q_lat = jnp.einsum("TNH,RNH->TNR", q_nope[start:end], w_uk.astype(q_nope.dtype))
        q = jnp.concatenate([q_lat, q_pe[start:end].astype(q_lat.dtype)], axis=-1)
        out_lat = dispatch.paged_mla_attention(
            q.reshape(rows, length, heads, -1),
            kv.entries,
            tables,
            seq_lens,
            latent_dim=r,
            sm_scale=sm_scale,
            layer=layer,
            impl=impl,
        )
        out_lat = out_lat.reshape(rows * length, heads, r)
        return jnp.einsum("TNR,RNH->TNH", out_lat, w_uv.astype(out_lat.dtype))

    outs, start = [], 0
    if md.num_decode:
        outs.append(absorbed(0, md.num_decode, 1, md.decode_tables, md.decode_seq_lens))
        start = md.num_decode
    if md.verify_rows:
        seq_lens = md.verify_context + md.verify_len
        outs.append(absorbed(start, md.verify_rows, md.verify_len, md.verify_tables, seq_lens))
        start += md.verify_rows * md.verify_len
    if md.prefill_rows:
        rows, length = md.prefill_rows, md.prefill_len
        if md.prefill_fresh:
            end = start + rows * length
            shape = (rows, length)
            out = expanded_attention(
                q_nope[start:end].reshape(*shape, heads, hn),
                q_pe[start:end].reshape(*shape, heads, -1),
                latent[start:end].reshape(*shape, r),
                k_pe[start:end].reshape(*shape, -1),
                w_up_rnh,
                kv_lens=md.prefill_num_new,
                sm_scale=sm_scale,
                impl=impl,
            )
            outs.append(out.reshape(rows * length, heads, hv))
        else:
            # Padded rows are given context + length tokens, as PagedKVCache does: their valid
            # queries still see only the keys before them, and padded queries are discarded.
            seq_lens = md.prefill_context + length
            outs.append(absorbed(start, rows, length, md.prefill_tables, seq_lens))
    out = jnp.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]
    pad = q_nope.shape[0] - out.shape[0]  # padding tokens after the prefill rows
    if pad:
        out = jnp.concatenate([out, jnp.zeros((pad, *out.shape[1:]), out.dtype)], axis=0)
    return out[None]


class LatentUp(nn.Module):
    """kv_b_proj's kernel [R, N * (Hn + Hv)], handed out as [R, N, Hn + Hv] (W_UK | W_UV per
    head) for the expanded and the absorbed forms."""

    num_heads: int
    head_width: int  # Hn + Hv

    @nn.compact
    def __call__(self, rank: int):
        kernel = self.param("kernel", _init, (rank, self.num_heads * self.head_width))
        return kernel.reshape(rank, self.num_heads, self.head_width)


class MLAttention(nn.Module):
    """Drop-in for `layers.Attention` (same call and params under "attn") for MLA configs.

    `kv`: None (no cache: expanded), or a latent cache (`cache.MLACache`): the step's entries
    are written first; a fresh step (no cached context) then attends expanded over its own tokens,
    any other step absorbed over the row's cached entries (``latent_context``)."""

    cfg: ModelConfig
    attn_impl: str | None = None

    @nn.compact
    def __call__(self, x, positions, kv, layer, md, lora=None):
        cfg, mla = self.cfg, self.cfg.mla
        if lora is not None:
            raise ValueError("LoRA adapters are not supported on Multi-head Latent Attention")
        b, t, _ = x.shape
        n, hn, hr, hv, r = (
            cfg.num_heads,
            mla.qk_nope_head_dim,
            mla.qk_rope_head_dim,
            mla.v_head_dim,
            mla.kv_lora_rank,
        )
        if mla.q_lora_rank is None:
            q = Linear(n * mla.qk_head_dim, name="q_proj")(x)
        else:
            q = Linear(mla.q_lora_rank, cfg.qkv_bias, name="q_a_proj")(x)
            q = RMSNorm(LATENT_NORM_EPS, name="q_a_layernorm")(q)
            q = Linear(n * mla.qk_head_dim, name="q_b_proj")(q)
        q = constrain(q.reshape(b, t, n, mla.qk_head_dim), "batch", "seq", "heads", "head_dim")
        compressed = Linear(mla.latent_dim, cfg.qkv_bias, name="kv_a_proj_with_mqa")(x)
        latent = RMSNorm(LATENT_NORM_EPS, name="kv_a_layernorm")(compressed[..., :r])
        rope = interleaved_rotary if mla.rope_interleave else rotary
        rope_args = (rope_inv_freq(cfg, hr), rope_attention_factor(cfg))
        q_nope, q_pe = q[..., :hn], rope(q[..., hn:], positions, *rope_args)
        k_pe = rope(compressed[:, :, None, r:], positions, *rope_args)[:, :, 0]
        w_up = LatentUp(n, hn + hv, name="kv_b_proj")(r)
        scale = softmax_scale(cfg)
        if kv is not None and not hasattr(kv, "latent_context"):
            raise ValueError(
                f"Multi-head Latent Attention needs a latent cache (cache.MLACache), got "
                f"{type(kv).__name__}"
            )
        if kv is not None:
            kv = kv.write_latent(layer, mla_cache_entry(latent, k_pe), md)
        if isinstance(md, RaggedMetadata):
            out = ragged_mla_attention(
                kv,
                layer,
                q_nope,
                q_pe,
                latent,
                k_pe,
                w_up,
                md,
                sm_scale=scale,
                impl=self.attn_impl,
            )
        elif kv is None or md.fresh:
            out = expanded_attention(
                q_nope,
                q_pe,
                latent,
                k_pe,
                w_up,
                kv_lens=md.num_new,
                sm_scale=scale,
                impl=self.attn_impl,
            )
        else:
            entries, kv_lens, q_offsets = kv.latent_context(layer, md)
            q_lat = jnp.einsum("BTNH,RNH->BTNR", q_nope, w_up[..., :hn].astype(q_nope.dtype))
            out_lat = absorbed_attention(
                q_lat,
                q_pe,
                entries,
                kv_lens=kv_lens,
                q_offsets=q_offsets,
                sm_scale=scale,
                impl=self.attn_impl,
            )
            out = jnp.einsum("BTNR,RNH->BTNH", out_lat, w_up[..., hn:].astype(out_lat.dtype))
        out = constrain(out, "batch", "seq", "heads", "head_dim")
        out = Linear(cfg.hidden_size, cfg.o_bias, name="o_proj")(out.reshape(b, t, n * hv))
        return out, kv
