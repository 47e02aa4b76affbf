"""The engine's GPU step programs compiled for an H100/H200 on a machine without a GPU:
`jaxgen bench gpu-compile` (or `python -m jaxgen.bench.gpu_compile`).

XLA:GPU compiles for a GPU described by a target config (`gpu_targets/*.txtpb`, from openxla/xla)
with no device present ("deviceless"): nothing runs, but the optimized HLO, every kernel the step
launches, the command-buffer (CUDA graph) regions, the buffer assignment and the PTX are all
there. Needs the `gpu-compile` extra (Python >= 3.12: the CUDA plugin of JAX 0.12.1 and nvcc's
ptxas; `make venv312`), and the CPU as JAX's runtime platform (`JAX_PLATFORMS=cpu`, set here
when JAX has not started its backends).

The programs, with abstract inputs (`jax.ShapeDtypeStruct`: no weights, no cache allocated):

  decode        `engine.runner.steps.decode` over the contiguous cache at `context` tokens
                (what `LLM.generate`'s decode loop runs each step; docs/gpu_decode.md's profile)
  decode-loop   `engine.runner.steps.decode_loop`: 8 greedy decode + sample steps in one
                on-device while loop (`LLM.generate`'s path; docs/gpu_decode.md's end-to-end rows)
  paged-decode  `engine.runner.packed.paged_step` with B decode rows over the page pool (the
                serving engine's decode-only step, sampling included)
  paged-mixed   `paged_step` with B decode rows and one 256-token prefill chunk continuing a
                cached prompt (the serving engine's mixed step)
  ragged-decode `paged_step` on the ragged step (`shapes.FlatShape`, what `jaxgen serve` and
                `LLM` run by default): B decode rows on a flat token axis of the token bucket
                holding B (`shapes.token_ladder`), the ragged paged attention over the pool
  ragged-mixed  the same with one 256-token chunk continuing a cached prompt beside the B
                decode rows (bucket of B + 256 tokens)

Weights are bf16, or int8 / int4 (group 128) / fp8 / mxfp4 / nvfp4 through `quant.formats`; the
layers run unrolled (`model.unroll_layers`, as the GPU benchmarks run them) unless `--scanned`.
For each program the report gives:

  kernels       kernel launches in XLA's thunk sequence (fusions, GEMMs, custom calls; those
                inside while loops and command buffers counted once each, as they appear)
  copies        copy thunks (device-to-device memcpy) and the copy/transpose fusions among the
                kernels
  launches      everything launched: kernels and copy thunks
  temp_bytes    XLA's temporary buffer (`compiled.memory_analysis()`)
  one_command_buffer   every launch of the step sits in a single command buffer (one CUDA graph)
  largest_temps the largest values in the temporary buffer, with the HLO instruction that
                defines each and its JAX op_name (where in the model it comes from)
  dequant_copies   weight-sized results of a fusion reading quantized codes (no dot in it): a
                dequantized or unpacked weight materialised in HBM instead of in its GEMM
  weight_sized_temps   weight-sized temporaries of a bf16 linear (a matrix-vector product XLA
                rewrote as a multiply into a weight-sized buffer plus a reduction)

Per-layer figures can be read from a program compiled at a small layer count (`--layers N`,
what the tests do): launches grow linearly with depth.

It prints a line per program as it compiles (`--json`: the whole result; `--out`: the JSON kept
in a file). The GPU suite's report renders that JSON as a table (`benchmarks/gpu_report.py`).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import glob
import importlib.util
import json
import os
import re
import sys
import tempfile
import time

TARGETS = {"h100": "h100_sxm.txtpb", "h200": "h200.txtpb"}
PROGRAMS = ("decode", "decode-loop", "paged-decode", "paged-mixed", "ragged-decode", "ragged-mixed")
LOOP_STEPS = 8  # decode steps of a `decode-loop` program
WEIGHTS = ("bf16", "int8", "int4", "fp8", "mxfp4", "nvfp4")
PAGE_SIZE = 16
PREFILL_CHUNK = 256
MAX_SEQS = 256  # max_num_seqs of the engine a ragged program is built for (vLLM's default)
_TARGET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_targets")


class GpuCompileUnavailable(RuntimeError):
    """Deviceless GPU compilation cannot run in this environment; the message says why and what
    to install."""


def unavailable_reason() -> str | None:
    """Why deviceless compilation cannot run here (None: it can)."""
    if sys.version_info < (3, 12):
        return (
            "deviceless GPU compiles need Python >= 3.12 with the `gpu-compile` extra "
            "(`make venv312`, then .venv312/bin/jaxgen bench gpu-compile)"
        )
    if importlib.util.find_spec("jax_plugins.xla_cuda13") is None:
        return "the CUDA plugin is not installed: pip install -e '.[gpu-compile]' (or make venv312)"
    import jax
    from jax._src import xla_bridge

    if xla_bridge._backends and jax.default_backend() != "cpu":
        return f"JAX already runs on {jax.default_backend()}: compile deviceless in a CPU process"
    if not xla_bridge._backends:
        jax.config.update("jax_platforms", "cpu")  # the plugin registers; its driver is not opened
    elif "cpu" not in (jax.config.jax_platforms or "cpu"):
        return "JAX_PLATFORMS must be cpu for deviceless GPU compiles"
    return None


def _check():
    reason = unavailable_reason()
    if reason is not None:
        raise GpuCompileUnavailable(reason)


@functools.cache
def target_mesh(target: str = "h200"):
    """A one-device mesh of the `target` GPU (a key of TARGETS), for abstract arguments."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {sorted(TARGETS)}, got {target!r}")
    _check()
    from jax.experimental import topologies

    with open(os.path.join(_TARGET_DIR, TARGETS[target])) as f:
        config = f.read()
    topo = topologies.get_topology_desc(platform="cuda", topology="1x1x1", target_config=config)
    return topologies.make_mesh(topo, (1,), ("x",))


# --- the model shapes ----------------------------------------------------------------------


def model_shapes() -> dict:
    """The model shapes by name: Llama-3-8B and SmolLM2-135M (the default model's shape), as the
    GPU suite's end-to-end run measures them (`bench.e2e`)."""
    from jaxgen.bench.e2e import LLAMA3_8B, SMOLLM2_135M

    return {"llama3-8b": LLAMA3_8B, "smollm2-135m": SMOLLM2_135M}


# --- abstract arguments ----------------------------------------------------------------------


def _abstract(tree, mesh):
    """Every array leaf of `tree` as a ShapeDtypeStruct placed on `mesh` (replicated)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    sharding = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def abstract_params(cfg, weights: str = "bf16", unrolled: bool = True):
    """The params tree of `cfg` as shapes only: bf16, or its linears quantized to `weights` (a
    `quant.formats` format; int4 in groups of 128)."""
    import jax
    import jax.numpy as jnp

    from jaxgen.model import init_params, unroll_layers
    from jaxgen.quant.apply import quantize_params

    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")

    def make(key):
        params = init_params(cfg, key, jnp.bfloat16)
        if weights != "bf16":
            group = 128 if weights == "int4" else None
            params = quantize_params(params, weights, group)
        return unroll_layers(params, cfg) if unrolled else params

    return jax.eval_shape(make, jax.random.key(0))


@dataclasses.dataclass(frozen=True)
class Program:
    """One step program: its name, model, batch, context and weights, and how it is built."""

    program: str
    model: str
    batch: int
    context: int
    weights: str = "bf16"
    num_layers: int | None = None  # None: the model's depth
    unrolled: bool = True
    # The attention path (`pallas_kernels.dispatch.IMPLS`); None: dispatch's default for the
    # target (the abstract mesh's GPU: "pallas"), what the engine runs.
    attn: str | None = None
    # Extra XLA options for the compile, as (name, value) pairs (e.g. what a flag would change).
    xla_options: tuple = ()

    @property
    def label(self) -> str:
        layers = f" L={self.num_layers}" if self.num_layers else ""
        layers += "" if self.attn is None else f" attn={self.attn}"
        layers += "".join(f" {k}={v}" for k, v in self.xla_options)
        return (
            f"{self.program} {self.model} B={self.batch} ctx={self.context} {self.weights}{layers}"
        )


def config_of(p: Program):
    cfg = model_shapes()[p.model]
    if p.num_layers:
        cfg = dataclasses.replace(cfg, num_layers=p.num_layers)
    return cfg


def lowered(p: Program, mesh):
    """`p`'s step function lowered with abstract arguments on `mesh` (inside its abstract mesh,
    which Pallas kernels need to lower for a GPU)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxgen.engine.runner import packed, steps

    cfg = config_of(p)
    params = _abstract(abstract_params(cfg, p.weights, p.unrolled), mesh)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        if p.program == "decode":
            from jaxgen.cache import KVCache

            # Room for the step's token past the context, rounded to the paged kernel's pages.
            max_len = -(-(p.context + 1) // 64) * 64
            kv = jax.eval_shape(lambda: KVCache.init(cfg, p.batch, max_len, jnp.bfloat16))
            kv = _abstract(kv, mesh)
            tokens = _abstract(jax.ShapeDtypeStruct((p.batch,), jnp.int32), mesh)
            active = _abstract(jax.ShapeDtypeStruct((p.batch,), jnp.bool_), mesh)
            return steps.decode.lower(params, tokens, kv, active, cfg=cfg, attn_impl=p.attn)
        if p.program == "decode-loop":
            from jaxgen.cache import KVCache
            from jaxgen.engine.params import SamplingParams
            from jaxgen.engine.sample.sampling import SamplingArrays

            max_len = -(-(p.context + LOOP_STEPS) // 64) * 64
            kv = jax.eval_shape(lambda: KVCache.init(cfg, p.batch, max_len, jnp.bfloat16))
            state = jax.eval_shape(
                lambda: steps.DecodeState.create(
                    cfg.vocab_size, max_tokens=np.full(p.batch, LOOP_STEPS)
                )
            )
            sa = SamplingArrays.build(
                [SamplingParams(temperature=0)] * p.batch, np.zeros((p.batch, 2), np.uint32)
            )
            args = _abstract((kv, state, sa), mesh)
            return steps.decode_loop.lower(
                params, *args, cfg=cfg, num_steps=LOOP_STEPS, attn_impl=p.attn
            )
        if p.program in ("paged-decode", "paged-mixed"):
            from jaxgen.cache.paged import PagedKVCache
            from jaxgen.engine.runner.shapes import StepShape, empty_step

            mixed = p.program == "paged-mixed"
            max_pages = -(-(p.context + (PREFILL_CHUNK if mixed else 1)) // PAGE_SIZE)
            rows = p.batch + int(mixed)
            shape = StepShape(
                num_decode=p.batch,
                verify_rows=0,
                verify_len=0,
                prefill_rows=int(mixed),
                prefill_len=PREFILL_CHUNK if mixed else 0,
                max_pages=max_pages,
                num_rows=rows,
                prefill_fresh=False,
                num_copies=1,
                stop_width=1,
            )
            batch, sa = empty_step(shape, cfg.vocab_size)
            num_pages = rows * max_pages + 1
            kv = jax.eval_shape(lambda: PagedKVCache.init(cfg, num_pages, PAGE_SIZE, jnp.bfloat16))
            args = _abstract((kv, batch, sa), mesh)
            return packed.paged_step.lower(params, *args, cfg=cfg, attn_impl=p.attn)
        if p.program in ("ragged-decode", "ragged-mixed"):
            from jaxgen.cache.paged import PagedKVCache
            from jaxgen.engine.runner.shapes import FlatShape, empty_flat_step, token_ladder

            mixed = p.program == "ragged-mixed"
            tokens = p.batch + (PREFILL_CHUNK if mixed else 0)
            rows = p.batch + int(mixed)
            # What `StepPacker.flat_shape` picks for this step on an engine of MAX_SEQS.
            bucket = next(t for t in token_ladder(tokens, MAX_SEQS) if t >= tokens)
            max_pages = -(-(p.context + (PREFILL_CHUNK if mixed else 1)) // PAGE_SIZE)
            shape = FlatShape(bucket, max(min(bucket, MAX_SEQS), rows), max_pages, MAX_SEQS)
            batch, sa = empty_flat_step(shape, cfg.vocab_size)
            num_pages = rows * max_pages + 1
            kv = jax.eval_shape(lambda: PagedKVCache.init(cfg, num_pages, PAGE_SIZE, jnp.bfloat16))
            args = _abstract((kv, batch, sa), mesh)
            return packed.paged_step.lower(
                params, *args, cfg=cfg, attn_impl=p.attn, num_logprobs=shape.num_logprobs
            )
    raise ValueError(f"program must be one of {PROGRAMS}, got {p.program!r}")


# --- reading what XLA wrote ------------------------------------------------------------------

# `NNN: kKind [links] name ...` lines of a thunk sequence dump; nesting by indentation.
_THUNK = re.compile(r"^(\s*)(\d+):\s+(k\w+)\s+\[[^\]]*\]\s*(\S*)")
# Thunks that launch device work (kernels, library calls, custom calls); copies apart.
_LAUNCH_KINDS = {
    "kKernel",
    "kCustomKernel",
    "kGemm",
    "kCublasLtMatmul",
    "kCustomCall",
    "kTriton",
    "kCuDnn",
    "kConvolution",
    "kFft",
    "kNorm",
    "kTopK",
    "kDynamicSliceFusion",
    "kSort",
    "kCubSort",
}
_COPY_KINDS = {"kCopy", "kDeviceToDeviceCopy", "kCopyDone", "kMemcpy"}
_MEMSET_KINDS = {"kMemset32BitValue", "kMemzero"}


@dataclasses.dataclass(frozen=True)
class Thunk:
    kind: str
    name: str
    depth: int  # nesting: 0 at the top, +1 inside a while body / command buffer
    in_command_buffer: bool


def parse_thunks(text: str) -> list[Thunk]:
    """The thunks of an XLA:GPU thunk sequence dump (`*thunk_sequence*.txt`), loops and
    command buffers flattened (each nested thunk listed once, with its depth)."""
    out, stack = [], []  # stack: (indent, kind) of the enclosing thunks
    for line in text.splitlines():
        m = _THUNK.match(line)
        if m is None:
            continue
        indent, _, kind, name = m.groups()
        width = len(indent)
        while stack and stack[-1][0] >= width:
            stack.pop()
        in_cb = any(k == "kCommandBuffer" for _, k in stack)
        out.append(Thunk(kind, name, len(stack), in_cb))
        stack.append((width, kind))
    return out


def _thunk_file(dump_dir: str) -> str:
    """The thunk sequence XLA runs: after its thunk passes (command buffers formed) when it
    wrote that file, else the one before."""
    for pattern in ("*thunk_sequence_after_thunk_passes.txt", "*thunk_sequence.txt"):
        paths = sorted(glob.glob(os.path.join(dump_dir, pattern)))
        if paths:
            return paths[-1]
    raise RuntimeError(f"XLA wrote no thunk sequence under {dump_dir}")


def count_thunks(thunks: list[Thunk], ops: dict) -> dict:
    """Launches, copies and the command-buffer layout of a thunk list (see the module doc)."""
    from jaxgen.bench.profile import classify

    launches = [t for t in thunks if t.kind in _LAUNCH_KINDS]
    copy_fusions = [t for t in launches if t.name in ops and classify(ops[t.name]) == "copy"]
    top = [t for t in thunks if t.depth == 0]
    top_launching = [
        t for t in top if t.kind in _LAUNCH_KINDS | _COPY_KINDS | {"kWhile", "kConditional"}
    ]
    outside = [
        t for t in thunks if not t.in_command_buffer and t.kind in _LAUNCH_KINDS | _COPY_KINDS
    ]
    buffers = [t for t in top if t.kind == "kCommandBuffer"]
    by_kind = collections.Counter(t.kind for t in thunks)
    return {
        "kernels": len(launches),
        "launches": len(launches) + sum(t.kind in _COPY_KINDS for t in thunks),
        "copies": sum(t.kind in _COPY_KINDS for t in thunks) + len(copy_fusions),
        "copy_thunks": sum(t.kind in _COPY_KINDS for t in thunks),
        "copy_fusions": len(copy_fusions),
        "memsets": sum(t.kind in _MEMSET_KINDS for t in thunks),
        "command_buffers": len(buffers),
        "launches_outside_command_buffers": len(outside),
        "one_command_buffer": len(buffers) == 1 and not outside and not top_launching,
        "thunk_kinds": dict(sorted(by_kind.items())),
    }


# `allocation N: size S, ... preallocated-temp:`, then its values:
# ` value: <id name @0> (size=..,offset=..): shape`.
_ALLOCATION = re.compile(r"^allocation \d+: size (\d+),(.*)$")
_VALUE = re.compile(
    r"^\s*value: <\d+ ([\w.\-]+)(?:\{[\d,]*\})? @\d+> \(size=(\d+),offset=\d+\): (.*)$"
)


def temporaries(buffer_assignment: str) -> list[tuple[str, int, str]]:
    """(defining instruction, bytes, shape) of every value placed in XLA's temporary buffer."""
    out, in_temp = [], False
    for line in buffer_assignment.splitlines():
        a = _ALLOCATION.match(line)
        if a is not None:
            in_temp = "preallocated-temp" in a.group(2)  # XLA:GPU packs all temps in one
            continue
        v = _VALUE.match(line)
        if v is not None and in_temp:
            out.append((v.group(1), int(v.group(2)), v.group(3).strip()))
    return out


def largest_temporaries(temps, ops: dict, n: int = 6) -> list[dict]:
    """The `n` largest temporary values (one per instruction) with their JAX op_name."""
    best = {}
    for name, size, shape in temps:
        if size > best.get(name, (0, ""))[0]:
            best[name] = (size, shape)
    top = sorted(best.items(), key=lambda kv: -kv[1][0])[:n]
    return [
        {
            "op": name,
            "bytes": size,
            "shape": shape,
            "origin": ops[name].op_name if name in ops else "",
        }
        for name, (size, shape) in top
    ]


# A computation's header: `%name (p0: s8[..], p1: bf16[..]) -> result {`.
_HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s+\((.*)\)\s+->\s+(.*)\{\s*$")
# Storage types of quantized weight codes (int8, packed 4-bit in uint8, fp8, sub-byte ints).
_CODE_TYPES = re.compile(r"\b(s8|u8|s4|u4|f8e\w+|f4e\w+)\[")


def _elements(shape: str) -> int:
    """Elements of the first array in an HLO shape string (`f32[36,1536]{1,0}` -> 55296)."""
    m = re.search(r"\[([\d,]*)\]", shape)
    n = 1
    for d in filter(None, (m.group(1) if m else "").split(",")):
        n *= int(d)
    return n


def quantized_inputs(hlo_text: str) -> set[str]:
    """Names of the computations (fusion bodies) that take quantized codes as a parameter."""
    found = set()
    for line in hlo_text.splitlines():
        m = _HEADER.match(line)
        if m is not None and _CODE_TYPES.search(m.group(2)):
            found.add(m.group(1))
    return found


def dequant_copies(ops: dict, temps, hlo_text: str, min_elements: int) -> list[dict]:
    """Temporaries of at least `min_elements` (the smallest weight matrix's) made by a fusion
    without a dot that reads quantized codes: the weight dequantized (or its 4-bit codes
    unpacked to bytes) and written to HBM instead of being unpacked inside its GEMM."""
    takes_codes = quantized_inputs(hlo_text)
    calls = {}
    for line in hlo_text.splitlines():
        m = re.search(r"%([\w.\-]+) = .*\bcalls=%([\w.\-]+)", line)
        if m:
            calls[m.group(1)] = m.group(2)
    hits = {}
    for name, size, shape in temps:
        op = ops.get(name)
        if op is None or _elements(shape) < min_elements or op.opcode != "fusion":
            continue
        if "dot" in op.body:
            continue
        if calls.get(name) in takes_codes:
            hits[name] = {"op": name, "bytes": size, "shape": shape, "origin": op.op_name}
    return sorted(hits.values(), key=lambda h: -h["bytes"])


def weight_sized_temps(ops: dict, temps, min_elements: int) -> list[dict]:
    """Temporaries of at least `min_elements` (the smallest weight matrix's) made by a fusion of a
    linear layer's matmul without a dot in it: XLA rewrote a matrix-vector product as a
    multiply into a weight-sized buffer and a reduction (its dot strength reduction), so the
    weight's bytes are written and read again."""
    hits = {}
    for name, size, shape in temps:
        op = ops.get(name)
        if op is None or _elements(shape) < min_elements or op.opcode != "fusion":
            continue
        if "dot" in op.body:
            continue
        if "dot_general" in op.op_name and "multiply" in op.body:
            hits[name] = {"op": name, "bytes": size, "shape": shape, "origin": op.op_name}
    return sorted(hits.values(), key=lambda h: -h["bytes"])


# --- compile and report ----------------------------------------------------------------------


def compile_program(p: Program, target: str = "h200", keep_dump: str | None = None) -> dict:
    """Compiles `p` for `target` (a key of TARGETS) on this machine and reports on it (see the
    module docstring for the fields). `keep_dump`: a folder to keep XLA's dump in."""
    from jaxgen.bench.profile import hlo_ops

    mesh = target_mesh(target)
    cfg = config_of(p)
    with tempfile.TemporaryDirectory() as tmp:
        dump = keep_dump or tmp
        os.makedirs(dump, exist_ok=True)
        t0 = time.perf_counter()
        low = lowered(p, mesh)
        import jax

        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            compiled = low.compile({**dict(p.xla_options), "xla_dump_to": dump})
        compile_s = time.perf_counter() - t0
        hlo = compiled.as_text()
        ops = hlo_ops(hlo)
        with open(_thunk_file(dump)) as f:
            thunks = parse_thunks(f.read())
        paths = sorted(glob.glob(os.path.join(dump, "*after_optimizations-buffer-assignment.txt")))
        if not paths:
            raise RuntimeError(f"XLA wrote no buffer assignment under {dump}")
        with open(paths[-1]) as f:
            temps = temporaries(f.read())
    mem = compiled.memory_analysis()
    kv_layer = (
        p.batch * (p.context + 1) * cfg.num_kv_heads * cfg.head_dim * 2
    )  # one layer's K at the context, bf16
    smallest_weight = cfg.hidden_size * cfg.num_kv_heads * cfg.head_dim
    counts = count_thunks(thunks, ops)
    layers = cfg.num_layers
    return {
        **dataclasses.asdict(p),
        "target": target,
        "model_layers": layers,
        **counts,
        "launches_per_layer": counts["launches"] / layers,
        "temp_bytes": int(mem.temp_size_in_bytes),
        "argument_bytes": int(mem.argument_size_in_bytes),
        "layer_kv_bytes": kv_layer,
        "largest_temps": largest_temporaries(temps, ops),
        "dequant_copies": dequant_copies(ops, temps, hlo, smallest_weight),
        "weight_sized_temps": weight_sized_temps(ops, temps, smallest_weight),
        "compile_s": compile_s,
    }


def default_grid(quick: bool = False) -> list[Program]:
    """The programs the docs' table holds (issue 64's rows and the mixed step)."""
    if quick:
        return [
            Program("decode", "smollm2-135m", 1, 1024, num_layers=2),
            Program("paged-mixed", "smollm2-135m", 4, 1024, num_layers=2),
        ]
    grid = []
    for model in ("llama3-8b", "smollm2-135m"):
        for batch in (1, 64, 256):
            grid.append(Program("decode", model, batch, 1024))
    grid += [
        Program("paged-decode", "llama3-8b", 1, 1024),
        Program("paged-decode", "llama3-8b", 64, 1024),
        Program("paged-mixed", "llama3-8b", 64, 1024),
        Program("ragged-decode", "llama3-8b", 1, 1024),
        Program("ragged-decode", "llama3-8b", 64, 1024),
        Program("ragged-mixed", "llama3-8b", 64, 1024),
        Program("decode", "llama3-8b", 1, 1024, "int8"),
        Program("decode", "llama3-8b", 1, 1024, "int4"),
    ]
    return grid


def run(
    programs: list[Program], target: str = "h200", out: str | None = None, progress=None
) -> dict:
    """Compiles each program (a failure is reported in its row); rewrites `out` after each and
    hands each row to `progress` (None: its `summary_line` to stderr). The Markdown table of the
    result is the GPU suite's report (`benchmarks/gpu_report.py`)."""
    rows = []
    for p in programs:
        try:
            row = compile_program(p, target)
        except GpuCompileUnavailable:
            raise
        except Exception as e:  # one program failing (a lowering) is reported, the rest run
            error = f"{type(e).__name__}: {e}"[:400]
            row = {**dataclasses.asdict(p), "target": target, "error": error}
        rows.append(row)
        if progress is None:
            print(summary_line(row), file=sys.stderr, flush=True)
        else:
            progress(row)
        if out:
            with open(out, "w") as f:
                json.dump(_result(rows, target), f, indent=1)
    return _result(rows, target)


def _result(rows, target) -> dict:
    import jax

    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return {"target": target, "jax": jax.__version__, "date": date, "rows": rows}


def size_text(n) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    return f"{n / (1 << 20):.1f} MiB"


def summary_line(row) -> str:
    """One program's row as one line: kernels, copies, temporaries, command buffer."""
    p = Program(**{f.name: row[f.name] for f in dataclasses.fields(Program)})
    if "error" in row:
        return f"{p.label}: {row['error']}"
    big = row["largest_temps"][0] if row["largest_temps"] else None
    return (
        f"{p.label}: {row['kernels']} kernels, {row['copies']} copies, temp "
        f"{size_text(row['temp_bytes'])}, one command buffer {row['one_command_buffer']}"
        + (f", largest {big['op']} {size_text(big['bytes'])}" if big else "")
    )


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="jaxgen bench gpu-compile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", default="h200", choices=sorted(TARGETS))
    p.add_argument("--programs", default=None, help=f"comma-separated of {','.join(PROGRAMS)}")
    p.add_argument("--models", default=None, help="comma-separated of llama3-8b,smollm2-135m")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes")
    p.add_argument("--weights", default=None, help=f"comma-separated of {','.join(WEIGHTS)}")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--layers", type=int, default=None, help="compile this many layers")
    p.add_argument("--scanned", action="store_true", help="layers under nn.scan (not unrolled)")
    p.add_argument(
        "--attn",
        default=None,
        help="attention impl (pallas_kernels.dispatch.IMPLS; default: the target's, as the engine)",
    )
    p.add_argument("--quick", action="store_true", help="two tiny programs")
    p.add_argument("--json", action="store_true", help="print JSON instead of a line per program")
    p.add_argument("--out", default=None, help="write the JSON here")
    p.add_argument("--dump", default=None, help="keep XLA's dump of the (single) program here")
    args = p.parse_args(argv)
    reason = unavailable_reason()
    if reason is not None:
        print(f"jaxgen bench gpu-compile: {reason}", file=sys.stderr)
        return 2
    if any(x is not None for x in (args.programs, args.models, args.batches, args.weights)):
        grid = [
            Program(prog, model, b, args.context, w, args.layers, not args.scanned, args.attn)
            for prog in (args.programs or "decode").split(",")
            for model in (args.models or "llama3-8b").split(",")
            for b in _ints(args.batches or "1")
            for w in (args.weights or "bf16").split(",")
        ]
    else:
        grid = default_grid(args.quick)
    # Without --json each program's line is the output, printed as it compiles.
    show = None if args.json else (lambda row: print(summary_line(row), flush=True))
    if args.dump:
        if len(grid) != 1:
            p.error("--dump keeps one program's dump: name one program, model, batch and weights")
        result = _result([compile_program(grid[0], args.target, args.dump)], args.target)
        if show is not None:
            show(result["rows"][0])
    else:
        result = run(grid, args.target, args.out, show)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.json:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
