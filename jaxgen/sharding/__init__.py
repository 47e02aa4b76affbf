"""Meshes, logical-axis rules, pipeline stages and multi-host start-up."""

from jaxgen.sharding.mesh import AXES, make_mesh, parse_mesh_spec, submeshes
from jaxgen.sharding.rules import logical_rules, param_shardings, shard_params

__all__ = [
    "AXES",
    "logical_rules",
    "make_mesh",
    "param_shardings",
    "parse_mesh_spec",
    "shard_params",
    "submeshes",
]
