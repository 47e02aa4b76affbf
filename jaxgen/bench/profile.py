"""What a compiled step's HLO launches: `hlo_ops(compiled.as_text())` and `classify(op)`.

`hlo_ops` reads every instruction of a compiled module's text, which says what it is (a cuBLAS
call, a Triton/Pallas kernel, a fusion and the operations inside it) and where it came from (its
`op_name`: the Flax module path, e.g. `layers/attn/q_proj/dot_general`). `classify` puts an
instruction in one of `CATEGORIES`:

  matmul        the linear layers and the LM head (cuBLAS, Triton GEMM fusions, dots)
  attention     attention kernels and the score/value products of XLA attention
  norm/rope/sampling   everything elementwise or reducing: norms, rotary, activations, softmax,
                the sampler
  cache write   dynamic-update-slice / scatter into the KV cache
  copy          copies, transposes and (dynamic-)slices materialised as their own kernels: a
                layer's weights sliced out of the stacked params show up here
  other         the rest (while-loop predicates, memsets, unattributed events)

The deviceless compile (`bench.gpu_compile`) counts copy kernels with it and the tests find
cache-sized copies (`large_copies`). Device time by category, from a profiler trace of the calls
(`profile_call`), is measured by the studies: `benchmarks/device_profile.py`.
"""

from __future__ import annotations

import collections
import dataclasses
import re

CATEGORIES = ("matmul", "attention", "norm/rope/sampling", "cache write", "copy", "other")

# One instruction of HLO text: `[ROOT] %name = <shape> opcode(operands), attrs...`.
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\(.*?\)|\S+)\s+([a-z][a-z0-9\-]*)\((.*)$")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_ATTR = {
    "calls": re.compile(r"calls=%?([\w.\-]+)"),
    "target": re.compile(r'custom_call_target="([^"]+)"'),
    "op_name": re.compile(r'op_name="([^"]+)"'),
    "kernel": re.compile(r'"name"\s*:\s*"([^"]+)"'),
}
_COPY_OPS = {"copy", "transpose", "slice", "dynamic-slice", "concatenate", "pad", "gather"}
_WRITE_OPS = {"dynamic-update-slice", "scatter"}
_PLUMBING = {
    "parameter",
    "constant",
    "bitcast",
    "get-tuple-element",
    "tuple",
    "broadcast",
    "reshape",
    "iota",
    "convert",
}
# Index arithmetic a copy or slice kernel may carry (clamped dynamic offsets).
_INDEXING = {
    "add",
    "subtract",
    "compare",
    "select",
    "clamp",
    "maximum",
    "minimum",
    "and",
    "or",
    "not",
}
CONTROL_OPS = {"while", "conditional", "call"}
_ATTENTION_NAMES = ("attention", "flash", "mha", "fmha", "paged")


@dataclasses.dataclass(frozen=True)
class Op:
    """One HLO instruction: its opcode, the opcodes of the computation it calls (a fusion's
    body), its custom-call target, its JAX op_name and a Pallas kernel's name."""

    name: str
    opcode: str
    body: frozenset = frozenset()
    shape: str = ""
    target: str = ""
    op_name: str = ""
    kernel: str = ""


def hlo_ops(text: str) -> dict[str, Op]:
    """Every instruction of a compiled module's text (`compiled.as_text()`), by name."""
    raw, bodies, current = {}, collections.defaultdict(set), None
    for line in text.splitlines():
        m = _INSTR.match(line)
        if m is None:
            c = _COMPUTATION.match(line)
            if c is not None and "=" not in line.split("{")[0]:
                current = c.group(1)
            continue
        name, shape, opcode, rest = m.groups()
        attrs = {k: (r.search(rest) or [None, ""])[1] for k, r in _ATTR.items()}
        raw[name] = (opcode, shape, attrs)
        if current is not None:
            bodies[current].add(opcode)
    ops = {}
    for name, (opcode, shape, attrs) in raw.items():
        body = set(bodies.get(attrs["calls"], ()))
        for inner in list(body):  # a fusion may wrap another computation (one level deeper)
            body |= bodies.get(inner, set())
        ops[name] = Op(
            name,
            opcode,
            frozenset(body),
            shape,
            attrs["target"],
            attrs["op_name"],
            attrs["kernel"],
        )
    return ops


_ARRAY = re.compile(r"\b(pred|[a-z]+\d+(?:e\d+m\d+\w*)?)\[([\d,]*)\]")


def result_bytes(op: Op) -> int:
    """Bytes of an instruction's result (the sum over a tuple's arrays)."""
    total = 0
    for dtype, dims in _ARRAY.findall(op.shape):
        bits = 8 if dtype == "pred" else int(re.search(r"\d+", dtype).group())
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * bits // 8
    return total


def large_copies(ops: dict[str, Op], min_bytes: int) -> list[tuple[str, int]]:
    """Instructions of the `copy` category whose result is at least `min_bytes`, largest first:
    a cache-sized one means the cache was not updated in place (donation not honoured)."""
    found = [(op.name, result_bytes(op)) for op in ops.values() if classify(op) == "copy"]
    return sorted([f for f in found if f[1] >= min_bytes], key=lambda f: -f[1])


def _is_attention_name(text: str) -> bool:
    text = text.lower()
    return any(k in text for k in _ATTENTION_NAMES)


def classify(op: Op | None) -> str:
    """The category (one of CATEGORIES) of the device time an instruction launches."""
    if op is None:
        return "other"
    ops = set(op.body) if op.opcode == "fusion" else {op.opcode}
    path = op.op_name.lower()
    in_attention = "/attn/" in path and not re.search(r"/attn/[\w]*_proj/", path)
    if op.opcode == "custom-call":
        target = op.target.lower()
        if "fmha" in target or _is_attention_name(op.kernel) or _is_attention_name(path):
            return "attention"
        if any(k in target for k in ("gemm", "cublas", "matmul")) or "dot" in op.kernel:
            return "matmul"
        return "other"
    if ops & _WRITE_OPS:
        return "cache write"
    if ops & _COPY_OPS and ops - _PLUMBING - _INDEXING <= _COPY_OPS:
        return "copy"
    if in_attention and ops - _PLUMBING - _INDEXING:
        return "attention"  # scores, softmax and the value product of XLA attention
    if "dot" in ops or "convolution" in ops or "__triton_gemm" in op.name:
        return "matmul"
    if op.opcode in CONTROL_OPS or not (ops - _PLUMBING):
        return "other"
    return "norm/rope/sampling"
