"""Which drafter a speculative config asks for, built for a target model: the one place that
knows every model-based drafter (`speculative.ModelDrafter` and its subclasses), so the drafter
modules need not import one another."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxgen.engine.spec_decode.mtp import MTPDrafter
from jaxgen.engine.spec_decode.speculative import ModelDrafter, SpeculativeConfig


def create_drafter(
    spec: SpeculativeConfig,
    target_cfg,
    target_params,
    engine_cfg,
    *,
    dtype,
    page_size,
    num_pages,
    placement=None,
) -> ModelDrafter:
    """The drafter of `spec.method` ("draft", "self" or "mtp"; n-gram needs none), with its own
    page pool of `num_pages` pages, placed like the target (`placement`)."""
    if spec.method == "mtp":
        from jaxgen.model.mtp import check_mtp

        check_mtp(target_cfg, target_params)
        return MTPDrafter(
            target_cfg, target_params, dtype, page_size, num_pages, engine_cfg, placement
        )
    if spec.method == "self":
        layers = spec.num_layers or max(1, target_cfg.num_layers // 4)
        if not 1 <= layers < target_cfg.num_layers:
            raise ValueError(
                f"self-draft layers must be in [1, {target_cfg.num_layers}), got {layers}"
            )
        cfg = dataclasses.replace(target_cfg, num_layers=layers)
        params = dict(target_params)
        params["layers"] = jax.tree.map(lambda a: a[:layers], target_params["layers"])
    else:
        from jaxgen.model import load_model

        cfg, params = load_model(spec.model, dtype=jnp.dtype(dtype).name, show_progress=False)
        if cfg.vocab_size != target_cfg.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({cfg.vocab_size} tokens) differs from the "
                f"target's ({target_cfg.vocab_size}); it must share the target's tokenizer"
            )
        if placement is not None:
            params = placement.params(params)
    return ModelDrafter(cfg, params, dtype, page_size, num_pages, engine_cfg, placement)
