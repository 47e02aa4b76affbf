"""Device meshes from a short spec: "dp=2,tp=4" -> axes (data, model, expert, seq, stage).

Every mesh has all five axes (size 1 when absent) so rules can name any of them. Axis types are
Auto: jit propagates shardings from the inputs and the model's logical constraints (GSPMD);
shard_map makes collectives explicit where needed (pipeline stages).
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("data", "model", "expert", "seq", "stage")
ALIASES = {
    "dp": "data",
    "tp": "model",
    "ep": "expert",
    "expert": "expert",
    "sp": "seq",
    "pp": "stage",
    "data": "data",
    "model": "model",
    "seq": "seq",
    "stage": "stage",
}


def parse_mesh_spec(spec: str | dict | None) -> dict[str, int]:
    """ "dp=2,tp=4" (or a dict) -> {"data": 2, "model": 4, "expert": 1, "seq": 1, "stage": 1}."""
    sizes = dict.fromkeys(AXES, 1)
    if spec is None or spec == "":
        return sizes
    items = (
        spec.items()
        if isinstance(spec, dict)
        else (part.split("=", 1) for part in str(spec).replace(" ", "").split(",") if part)
    )
    for key, value in items:
        if key not in ALIASES:
            raise ValueError(
                f"unknown mesh axis {key!r}; use dp, tp, ep, sp, pp (e.g. 'dp=2,tp=4')"
            )
        try:
            size = int(value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"mesh axis {key} needs an integer size, got {value!r}") from e
        if size < 1:
            raise ValueError(f"mesh axis {key} must be >= 1, got {size}")
        sizes[ALIASES[key]] = size
    return sizes


def make_mesh(spec: str | dict | None = None, devices=None) -> Mesh:
    """A mesh over `devices` (default: all) with axes (data, model, expert, seq, stage)."""
    sizes = parse_mesh_spec(spec)
    devices = list(jax.devices() if devices is None else devices)
    need = math.prod(sizes.values())
    if need > len(devices):
        raise ValueError(
            f"mesh {spec!r} needs {need} devices, {len(devices)} are available "
            f"({jax.default_backend()})"
        )
    devices = devices[:need]  # a smaller mesh uses the first devices
    shape = tuple(sizes[a] for a in AXES)
    return Mesh(np.asarray(devices).reshape(shape), AXES, axis_types=(AxisType.Auto,) * len(AXES))


def submeshes(mesh: Mesh, axis: str = "data") -> list[Mesh]:
    """One mesh per index of `axis` (data-parallel replicas), each keeping the other axes."""
    index = mesh.axis_names.index(axis)
    out = []
    for i in range(mesh.shape[axis]):
        devices = np.take(mesh.devices, [i], axis=index)
        out.append(Mesh(devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(AXES)))
    return out
