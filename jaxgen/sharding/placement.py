"""Where a model's arrays live on a mesh, and the context its jitted steps trace under."""

from __future__ import annotations

import contextlib
import dataclasses

import flax.linen as nn
import jax
from jax.sharding import Mesh

from jaxgen.model.llama import param_logical_axes
from jaxgen.sharding.mesh import make_mesh, submeshes
from jaxgen.sharding.pipeline import PipelineSpec
from jaxgen.sharding.rules import logical_rules, shard_params


@dataclasses.dataclass
class Placement:
    """A model on one mesh: its rules, its pipeline (if the mesh has stages) and helpers to
    place params and caches shard by shard."""

    cfg: object
    mesh: Mesh
    microbatches: int | None = None

    def __post_init__(self):
        self.sequence_parallel = self.mesh.shape["seq"] > 1
        stages = self.mesh.shape["stage"]
        self.rules = logical_rules(
            self.cfg, self.mesh, sequence_parallel=self.sequence_parallel, pipeline=stages > 1
        )
        self.pipeline = None
        m = self.microbatches
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise ValueError(f"pipeline_microbatches must be an int >= 1, got {m!r}")
        if stages > 1:
            if self.cfg.moe is not None and self.cfg.moe.first_dense_layers:
                raise ValueError(
                    "pipeline stages (pp) need one uniform layer stack; this MoE model's first "
                    f"{self.cfg.moe.first_dense_layers} layers are dense: use tp/dp instead"
                )
            if self.cfg.num_layers % stages:
                raise ValueError(
                    f"{self.cfg.num_layers} layers cannot be split into {stages} pipeline stages"
                )
            self.pipeline = PipelineSpec(self.mesh, self.microbatches or stages)

    @classmethod
    def from_spec(cls, cfg, spec, microbatches=None, devices=None) -> Placement:
        return cls(cfg, make_mesh(spec, devices), microbatches)

    def replicas(self) -> list[Placement]:
        """One placement per data-parallel index (for engines that cannot split a batch)."""
        return [Placement(self.cfg, m, self.microbatches) for m in submeshes(self.mesh)]

    @contextlib.contextmanager
    def context(self):
        with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
            yield

    def params(self, params):
        return shard_params(params, self.mesh, self.rules, param_logical_axes(params))

    def cache(self, kv):
        return shard_params(kv, self.mesh, self.rules, kv.logical_axes())

    def describe(self) -> dict:
        out = {
            "mesh": dict(self.mesh.shape),
            "devices": self.mesh.size,
            "kv_heads_replicated": dict(self.rules)["kv_heads"] is None
            and self.mesh.shape["model"] > 1,
            "sequence_parallel_attention": "all-gather of K/V" if self.sequence_parallel else None,
            "expert_parallel": (
                f"{self.cfg.moe.num_experts // self.mesh.shape['expert']} experts per device, "
                "tokens by all-to-all"
                if self.mesh.shape["expert"] > 1
                else None
            ),
        }
        if self.pipeline is not None:
            out.update(
                pipeline_stages=self.pipeline.stages,
                microbatches=self.pipeline.microbatches,
                bubble_fraction=self.pipeline.bubble_fraction,
            )
        return out
