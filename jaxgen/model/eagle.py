"""EAGLE draft heads (Li et al. 2024, EAGLE-1/2; Li et al. 2025, EAGLE-3): one small decoder
layer that drafts the target's next tokens from the target's own hidden states, used
functionally like the rest of `model/`.

The head's entry at position j reads the target's state at j and the embedding of the token
after it, t_{j+1}, and predicts t_{j+2} (as `model.mtp` does):

  EAGLE-1/2 (same head; EAGLE-2 changed only the draft tree):
    x_j = fc([embed(t_{j+1}) | h_j])                    h: the target's last state after its
    g_j = layer(x_j)  (no norm before attention)           final norm; fc [2D -> D] with bias
    logits_j = target_lm_head(g_j)                      g_j is trained to be h_{j+1}
  EAGLE-3:
    f_j = fc([s_low | s_mid | s_high]_j)                s: the residual stream entering three
                                                           target layers (low, middle, high)
    g_j = layer([input_norm(embed(t_{j+1})) | hidden_norm(f_j)]) with residual f_j
    logits_j = lm_head(norm(g_j))                       over the head's own (possibly reduced)
                                                           vocabulary; `draft_to_target` maps it

Drafting k tokens is a chain: step s >= 1 reads the head's own g of the step before in place of
the target's state, and the token it drafted; its attention sees the context's entries (made
from the target's states) and its own chain (`chain_draft`). EAGLE-3 trains exactly that
("training-time test", `unrolled_forward`); EAGLE-1/2 train one step on the target's states.

Params: {"fc", "layer": {"attn_norm" (EAGLE-3 only), "hidden_norm" (EAGLE-3 only), "q_proj",
"k_proj", "v_proj", "o_proj", "mlp_norm", "mlp"}, "norm" and "lm_head" (EAGLE-3 only)}; the
token embedding is the target's unless a checkpoint brings its own ("embed"). HF layout:
`model.eagle_io`.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.model.config import ModelConfig, RopeScaling, rope_inv_freq
from jaxgen.model.layers import MLP, Linear, RMSNorm, rotary
from jaxgen.model.mtp import shared_head

VERSIONS = (1, 2, 3)
# Finite mask value: -inf - -inf = NaN in a fully masked row's softmax.
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's fused target layers: the states entering layers 2, L/2 and L-3 (EAGLE-3's
    reference code and vLLM's default), clipped into [0, L] for very shallow targets."""
    low, mid, high = 2, num_layers // 2, num_layers - 3
    return tuple(min(max(i, 0), num_layers) for i in (low, mid, high))


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    """One EAGLE head. The head's layer has the target's shape in the public checkpoints (and
    in `for_target`), but need not."""

    version: int  # 1, 2 (the same head) or 3
    hidden_size: int  # D of the head
    intermediate_size: int  # F
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    vocab_size: int  # V: the target's vocabulary (the embedding's rows)
    target_hidden_size: int  # the target's D (EAGLE-3's fc reads 3 of its states)
    draft_vocab_size: int | None = None  # EAGLE-3: the head's own LM head's rows (None: V)
    aux_layers: tuple[int, ...] = ()  # EAGLE-3: the target layers whose input states are fused
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 2048

    def __post_init__(self):
        if self.version not in VERSIONS:
            raise ValueError(f"EAGLE version must be one of {VERSIONS}, got {self.version!r}")
        if self.version == 3 and len(self.aux_layers) != 3:
            raise ValueError(
                f"an EAGLE-3 head fuses three target layers (low, middle, high); got "
                f"aux_layers={self.aux_layers!r}"
            )
        if self.version < 3:
            if self.aux_layers or self.draft_vocab_size is not None:
                raise ValueError(
                    "EAGLE-1/2 heads read the target's last state and use its LM head: "
                    "aux_layers and draft_vocab_size are EAGLE-3 only"
                )
            if self.hidden_size != self.target_hidden_size:
                raise ValueError(
                    f"an EAGLE-1/2 head predicts the target's next state: hidden_size "
                    f"({self.hidden_size}) must equal target_hidden_size "
                    f"({self.target_hidden_size})"
                )
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in [1, vocab_size={self.vocab_size}], got "
                f"{self.draft_vocab_size}"
            )
        # The layer's own checks (head counts, even head_dim).
        self.layer_config  # noqa: B018

    @classmethod
    def for_target(
        cls,
        target: ModelConfig,
        version: int = 3,
        draft_vocab_size: int | None = None,
        aux_layers: tuple[int, ...] | None = None,
    ) -> EagleConfig:
        """A head shaped like one of the target's layers (as the public heads are)."""
        if target.mla is not None or target.moe is not None:
            raise ValueError(
                f"EAGLE heads are built for grouped-query-attention targets; {target.arch} "
                "uses MLA or MoE layers (its MTP module is the drafter: speculative 'mtp')"
            )
        if version == 3 and aux_layers is None:
            aux_layers = default_aux_layers(target.num_layers)
        return cls(
            version=version,
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            vocab_size=target.vocab_size,
            target_hidden_size=target.hidden_size,
            draft_vocab_size=draft_vocab_size if version == 3 else None,
            aux_layers=tuple(aux_layers or ()) if version == 3 else (),
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling,
            max_position_embeddings=target.max_position_embeddings,
        )

    @property
    def layer_config(self) -> ModelConfig:
        """The head's decoder layer as a one-layer Llama config (for `layers.MLP` and rope)."""
        return ModelConfig(
            arch="llama",
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=1,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
        )

    @property
    def head_vocab_size(self) -> int:
        """Rows of the head's logits: the draft vocabulary (EAGLE-3) or the target's."""
        return self.draft_vocab_size or self.vocab_size

    def check_target(self, target: ModelConfig) -> None:
        """Raises if this head cannot draft for `target`."""
        problems = []
        if target.vocab_size != self.vocab_size:
            problems.append(f"vocab_size {self.vocab_size} vs the target's {target.vocab_size}")
        if target.hidden_size != self.target_hidden_size:
            problems.append(
                f"target_hidden_size {self.target_hidden_size} vs the target's {target.hidden_size}"
            )
        if any(not 0 <= i <= target.num_layers for i in self.aux_layers):
            problems.append(f"aux_layers {self.aux_layers} vs {target.num_layers} target layers")
        if problems:
            raise ValueError("this EAGLE head was not made for this target: " + "; ".join(problems))


class EagleLayer(nn.Module):
    """The head's decoder layer over one step's entries, attending to earlier entries' keys and
    values (`past_k`, `past_v`) and its own under `mask`."""

    cfg: EagleConfig

    @nn.compact
    def __call__(self, emb, hidden, positions, past_k, past_v, mask):
        """emb, hidden: [B, T, D]; positions: i32[B, T]; past_k, past_v: [B, S, K, H];
        mask: bool[B, T, S + T] (True: may attend). Returns (g [B, T, D], k, v [B, T, K, H])."""
        cfg, lc = self.cfg, self.cfg.layer_config
        b, t, _ = hidden.shape
        n, kh, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if cfg.version == 3:
            x = jnp.concatenate(
                [
                    RMSNorm(cfg.rms_norm_eps, name="attn_norm")(emb),
                    RMSNorm(cfg.rms_norm_eps, name="hidden_norm")(hidden),
                ],
                axis=-1,
            )
        else:  # EAGLE-1's first (only) layer has no input norm: fc's output goes in as is
            x = hidden
        inv_freq = rope_inv_freq(lc)
        q_btnh = Linear(n * h, name="q_proj")(x).reshape(b, t, n, h)
        k_btkh = Linear(kh * h, name="k_proj")(x).reshape(b, t, kh, h)
        v_btkh = Linear(kh * h, name="v_proj")(x).reshape(b, t, kh, h)
        q_btnh, k_btkh = rotary(q_btnh, positions, inv_freq), rotary(k_btkh, positions, inv_freq)
        keys = jnp.concatenate([past_k, k_btkh], axis=1)
        values = jnp.concatenate([past_v, v_btkh], axis=1)
        q_btkgh = q_btnh.reshape(b, t, kh, n // kh, h)
        scores = jnp.einsum("BTKGH,BSKH->BTKGS", q_btkgh, keys, preferred_element_type=jnp.float32)
        scores = jnp.where(mask[:, :, None, None, :], scores * h**-0.5, _MASKED)
        probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
        out = jnp.einsum("BTKGS,BSKH->BTKGH", probs, values).reshape(b, t, n * h)
        x = hidden + Linear(cfg.hidden_size, name="o_proj")(out)
        x = x + MLP(lc, name="mlp")(RMSNorm(cfg.rms_norm_eps, name="mlp_norm")(x))
        return x, k_btkh, v_btkh


class _Init(nn.Module):
    """Creates every param of a head (init only)."""

    cfg: EagleConfig

    @nn.compact
    def __call__(self, states, emb):
        cfg = self.cfg
        fc_in = 3 * cfg.target_hidden_size if cfg.version == 3 else 2 * cfg.hidden_size
        hidden = Linear(cfg.hidden_size, cfg.version < 3, name="fc")(states[..., :fc_in])
        b, t, _ = hidden.shape
        empty = jnp.zeros((b, 0, cfg.num_kv_heads, cfg.head_dim), hidden.dtype)
        pos = jnp.zeros((b, t), jnp.int32)
        g, _, _ = EagleLayer(cfg, name="layer")(
            emb, hidden, pos, empty, empty, jnp.ones((b, t, t), bool)
        )
        if cfg.version == 3:
            g = Linear(cfg.head_vocab_size, name="lm_head")(
                RMSNorm(cfg.rms_norm_eps, name="norm")(g)
            )
        return g


def init_params(cfg: EagleConfig, rng: jax.Array, dtype=jnp.float32) -> dict:
    """Random head params (normal(0.02) weights, unit norms, zero fc bias) as a plain dict."""
    width = max(3 * cfg.target_hidden_size, 2 * cfg.hidden_size)
    states = jnp.zeros((1, 1, width), jnp.float32)
    emb = jnp.zeros((1, 1, cfg.hidden_size), jnp.float32)
    params = jax.jit(_Init(cfg).init)(rng, states, emb)["params"]
    return jax.tree.map(lambda p: p.astype(dtype), params)


def token_embedding(params: dict, target_params: dict) -> jax.Array:
    """The head's own embedding when its checkpoint brought one, else the target's."""
    return params["embed"] if "embed" in params else target_params["embed"]


def fuse(cfg: EagleConfig, params: dict, states: jax.Array) -> jax.Array:
    """The head's step-0 hidden input from the target's states: EAGLE-3 fuses [3, B, T, Dt]
    through fc into [B, T, D]; EAGLE-1/2 take the last state [B, T, D] as it is (their fc mixes
    it with the token embedding inside `step`)."""
    if cfg.version < 3:
        return states
    fused = jnp.concatenate(list(states), axis=-1)
    return Linear(cfg.hidden_size).apply({"params": params["fc"]}, fused.astype(states.dtype))


def step(cfg: EagleConfig, params: dict, embed, hidden, tokens, positions, past_k, past_v, mask):
    """One head step: (g [B, T, D], k, v [B, T, K, H]) for `hidden` [B, T, D] (fused target
    states or the head's previous g) and the tokens after them i32[B, T] (target ids)."""
    emb = jnp.take(embed, tokens, axis=0).astype(hidden.dtype)
    if cfg.version < 3:
        fc = Linear(cfg.hidden_size, True).apply(
            {"params": params["fc"]}, jnp.concatenate([emb, hidden], -1)
        )
        hidden = fc
    return EagleLayer(cfg).apply(
        {"params": params["layer"]}, emb, hidden, positions, past_k, past_v, mask
    )


def logits(cfg: EagleConfig, params: dict, target_cfg: ModelConfig, target_params: dict, g):
    """f32 logits [..., head_vocab_size] of head outputs g: EAGLE-3's own norm and LM head, or
    (EAGLE-1/2) the target's LM head on g, a predicted target state."""
    if cfg.version < 3:
        return shared_head(target_cfg, target_params, g)
    x = RMSNorm(cfg.rms_norm_eps).apply({"params": params["norm"]}, g)
    return Linear(cfg.head_vocab_size).apply({"params": params["lm_head"]}, x).astype(jnp.float32)


def to_target_ids(draft_to_target, ids):
    """Head-vocabulary ids -> target ids (identity without a reduced draft vocabulary)."""
    return ids if draft_to_target is None else jnp.take(draft_to_target, ids, axis=0)


def causal_mask(batch: int, num_tokens: int) -> jax.Array:
    return jnp.broadcast_to(
        jnp.tril(jnp.ones((num_tokens, num_tokens), bool)), (batch, num_tokens, num_tokens)
    )


def unrolled_forward(cfg: EagleConfig, params: dict, embed, states, tokens, *, num_steps: int):
    """EAGLE-3's training-time test: the chain of `num_steps` drafting steps started at every
    position at once (EAGLE-3 §3.3). Chain j's step s reads the head's own output of step s-1
    (the target's fused state at step 0) and the true token t_{j+s+1}, sits at position j + s,
    attends to the step-0 entries at positions <= j and to its own chain, and predicts
    t_{j+s+2}: what `chain_draft` computes when drafting from position j.

    Args:
      states: the target's states for `fuse` ([3, B, T, Dt] or [B, T, D]).
      tokens: i32[B, T], the sequence t_0..t_{T-1}.
    Returns:
      g f32[num_steps, B, T, D]; entries whose inputs run past T - 1 hold garbage (a loss
      masks them: chain j's step s is valid for j + s + 1 <= T - 1).
    """
    b, t = tokens.shape
    hidden = fuse(cfg, params, states)
    base = jnp.arange(t, dtype=jnp.int32)
    # Step s's mask over [step 0's T keys | steps 1..s's T keys]: causal, then diagonal blocks.
    causal = np.tril(np.ones((t, t), bool))
    eye = np.eye(t, dtype=bool)
    empty = jnp.zeros((b, 0, cfg.num_kv_heads, cfg.head_dim), hidden.dtype)
    past_k, past_v, outs = empty, empty, []
    for s in range(num_steps):
        step_tokens = jnp.pad(tokens[:, s + 1 :], ((0, 0), (0, s + 1)))
        positions = jnp.broadcast_to(base + s, (b, t))
        mask = np.concatenate([causal] + [eye] * s, axis=1)
        g, k, v = step(
            cfg,
            params,
            embed,
            hidden,
            step_tokens,
            positions,
            past_k,
            past_v,
            jnp.broadcast_to(jnp.asarray(mask), (b, t, (s + 1) * t)),
        )
        past_k = jnp.concatenate([past_k, k], axis=1)
        past_v = jnp.concatenate([past_v, v], axis=1)
        outs.append(g)
        hidden = g
    return jnp.stack(outs)


def chain_draft(
    cfg: EagleConfig,
    params: dict,
    draft_to_target,
    target_cfg: ModelConfig,
    target_params: dict,
    states,
    next_tokens,
    *,
    num_steps: int,
):
    """Greedy chain drafting of `num_steps` tokens after a context of W positions (jittable).

    Args:
      draft_to_target: i32[Vd] head ids -> target ids, or None (full vocabulary).
      states: the target's states at the context's positions 0..W-1 ([3, B, W, Dt] EAGLE-3,
        [B, W, D] EAGLE-1/2).
      next_tokens: i32[B, W]: the token after each context position (the last one is the
        target's token after the context, which the chain extends).
    Returns:
      (drafts i32[B, num_steps] target ids, draft_logprobs f32[B, num_steps, Vh]: the head's
      log-distribution at each drafted position over its vocabulary).
    """
    b, w = next_tokens.shape
    embed = token_embedding(params, target_params)
    hidden = fuse(cfg, params, states)
    positions = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))
    empty = jnp.zeros((b, 0, cfg.num_kv_heads, cfg.head_dim), hidden.dtype)
    g, past_k, past_v = step(
        cfg, params, embed, hidden, next_tokens, positions, empty, empty, causal_mask(b, w)
    )
    g = g[:, -1:]
    drafts, logps = [], []
    for s in range(num_steps):
        logp = jax.nn.log_softmax(logits(cfg, params, target_cfg, target_params, g)[:, 0], -1)
        draft = to_target_ids(draft_to_target, jnp.argmax(logp, axis=-1).astype(jnp.int32))
        drafts.append(draft)
        logps.append(logp)
        if s + 1 == num_steps:
            break
        positions = jnp.full((b, 1), w + s, jnp.int32)
        mask = jnp.ones((b, 1, past_k.shape[1] + 1), bool)
        g, k, v = step(cfg, params, embed, g, draft[:, None], positions, past_k, past_v, mask)
        past_k = jnp.concatenate([past_k, k], axis=1)
        past_v = jnp.concatenate([past_v, v], axis=1)
    return jnp.stack(drafts, axis=1), jnp.stack(logps, axis=1)
