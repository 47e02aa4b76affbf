"""Quantizing whole parameter trees: every stacked linear kernel (a `kernel` leaf under
`layers`, shape [L, in, out]) becomes a QArray; embeddings, norms and biases stay as they are."""

from __future__ import annotations

import jax

from jaxgen.quant.formats import QArray, quantize_rtn


def linear_paths(params) -> list[tuple[str, ...]]:
    """Paths (e.g. ('layers', 'attn', 'q_proj', 'kernel')) of the stacked linear kernels."""
    paths = []

    def visit(node, prefix):
        if isinstance(node, dict):
            for key in sorted(node):
                visit(node[key], prefix + (key,))
        elif prefix[0] == "layers" and prefix[-1] == "kernel":
            paths.append(prefix)

    visit(params, ())
    return paths


def get_path(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def set_path(tree, path, value):
    """A copy of the nested dict `tree` with `path` set to `value` (other branches shared)."""
    if not path:
        return value
    new = dict(tree)
    new[path[0]] = set_path(tree[path[0]], path[1:], value)
    return new


def map_linears(params, fn):
    """Replaces each stacked linear kernel k by fn(path, k)."""
    for path in linear_paths(params):
        params = set_path(params, path, fn(path, get_path(params, path)))
    return params


def quantize_params(params, fmt: str, group_size: int | None = None, **kwargs):
    """Round-to-nearest quantization of every linear (see `quant.formats.quantize_rtn`)."""
    return map_linears(params, lambda path, w: quantize_rtn(w, fmt, group_size, **kwargs))


def weight_bytes(params) -> dict:
    """Bytes of the linear weights and of everything (embeddings and norms included)."""
    linears = sum(
        get_path(params, p).nbytes
        if isinstance(get_path(params, p), QArray)
        else get_path(params, p).nbytes
        for p in linear_paths(params)
    )
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    return {"linear_bytes": linears, "total_bytes": total}
