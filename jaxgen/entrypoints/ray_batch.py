"""`jaxgen batch --ray` and `run_ray_batch`: a batch job as a Ray Data pipeline.

    input (JSONL or Parquet, local or any `pyarrow.fs` URI: s3://, gs://, hdfs://, ...)
      -> blocks of `batch_size` numbered lines (read on the driver)
      -> map_batches(Replica): an actor pool of `replicas` engines, each one `LLM`; a block is
         admitted to the engine whole (continuous batching inside the actor), and its rows
         come back when every request of the block is done; two blocks are in flight per
         replica (two threads on one engine), so a block's low-batch tail overlaps the next
      -> the driver appends the rows in the OpenAI batch-output shape: one JSONL file (as
         `jaxgen batch` writes) or a directory of Parquet part files.

Every line goes through the same code as `jaxgen batch` (`batch.admit_lines`: parsing,
validation, request building; `batch.EngineDriver`: stepping, the output records), so a row's
result does not depend on which path ran it. Exactly once: ids already in the output are skipped
when the job (re)starts; a replica killed mid-block loses only its blocks' unfinished work, which
Ray retries on a restarted or another replica (`max_retries`); and the driver never writes an id
twice (a re-delivered row is counted as a duplicate and dropped). Per-request seeds derive from
the job seed and the id, so a resumed or re-balanced job writes what an uninterrupted one would
(bitwise, with `llm_options["batch_invariant"]`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
import uuid
import warnings

from jaxgen.engine.params import SamplingParams
from jaxgen.entrypoints.batch import (
    BatchJobError,
    EngineDriver,
    JobStats,
    check_input,
    check_output,
    done_ids,
    line_id,
    result_fields,
)
from jaxgen.entrypoints.tool_calls import ToolParser


class RayNotInstalled(BatchJobError):
    """`--ray` without Ray."""


def import_ray():
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise RayNotInstalled(
            "batch jobs on Ray need Ray Data: pip install 'jaxgen[ray]' (or drop --ray to run "
            "the job in this process)"
        ) from None
    return ray


@dataclasses.dataclass(frozen=True)
class JobOptions:
    """What every replica applies to its lines (the `jaxgen batch` flags)."""

    defaults: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    seed: int | None = 0
    raw: bool = False
    model_name: str = "default"
    tool_call_parser: str | None = None


# A local cluster that `run_ray_batch` starts itself keeps no idle worker process: none
# prestarted, and one left idle (a worker that ran a task) is stopped after a second. An idle
# Python worker wakes every 10 ms for the whole job (Ray's signal check) on the cores the
# engine uses (measured: `docs/serving.md`, section batch). RayConfig reads these from the
# environment of the processes `ray.init` starts; a cluster joined keeps its own settings.
LOCAL_CLUSTER_CONFIG = {
    "RAY_prestart_worker_first_driver": "0",
    "RAY_enable_worker_prestart": "0",
    "RAY_num_workers_soft_limit": "0",
}
BLOCKS_IN_FLIGHT = 2  # per replica: one draining its tail, the next one filling the batch
OUTPUT_COLUMNS = ("output", "error", "custom_id", "tokens", "empty", "reasons", "ttft", "tpot")


class Replica:
    """One engine of the actor pool: `LLM(model, **llm_options)`, fed one block at a time."""

    def __init__(self, model, llm_options: dict, job: JobOptions):
        from jaxgen import LLM

        self.llm = LLM(model, **llm_options)
        self.driver = EngineDriver(self.llm)
        self.job = job
        self.tool_parser = ToolParser(self.llm.tokenizer, job.tool_call_parser)

    def __call__(self, batch):
        import pyarrow as pa

        start = time.time()
        job = self.job
        lines = zip(batch["line"].to_pylist(), batch["text"].to_pylist(), strict=True)
        admitted = self.driver.admit(lines, job.defaults, job.seed, job.raw, self.tool_parser)
        rows = {c: [] for c in OUTPUT_COLUMNS}
        for record, result in self.driver.finished_records(admitted.pending, job.model_name):
            fields = result_fields(result)
            fields["reasons"] = json.dumps(fields["reasons"])
            row = dict(
                output=json.dumps(record),
                error=None,
                custom_id=json.dumps(record["custom_id"]),
                **fields,
            )
            for c in OUTPUT_COLUMNS:
                rows[c].append(row[c])
        for error in admitted.errors:
            for c in OUTPUT_COLUMNS:
                rows[c].append(json.dumps(error) if c == "error" else None)
        n = len(rows["output"])
        rows["replica"] = [f"{os.uname().nodename}:{os.getpid()}"] * n
        rows["block"] = [uuid.uuid4().hex] * n
        rows["block_start"] = [start] * n
        rows["block_end"] = [time.time()] * n
        types = dict(tokens=pa.int64(), empty=pa.int64(), ttft=pa.float64(), tpot=pa.float64())
        types.update(block_start=pa.float64(), block_end=pa.float64())
        return pa.table({c: pa.array(v, types.get(c, pa.string())) for c, v in rows.items()})


# ------------------------------------------------------------------------------------------
# Input and output
# ------------------------------------------------------------------------------------------
def _filesystem(path: str):
    """(pyarrow FileSystem, path in it): a URI with a scheme, or a local path."""
    from pyarrow import fs

    if "://" in path:
        return fs.FileSystem.from_uri(path)
    return fs.LocalFileSystem(), os.path.abspath(path)


def is_parquet(path: str) -> bool:
    return path.rstrip("/").endswith(".parquet")


def read_lines(in_path: str):
    """Yields (number, JSON text) of each non-blank input line (JSONL) or row (Parquet: each
    row as a JSON object, numbered from 1)."""
    filesystem, path = _filesystem(in_path)
    try:
        if is_parquet(in_path):
            import pyarrow.dataset as ds

            number = 0
            for batch in ds.dataset(path, filesystem=filesystem, format="parquet").to_batches():
                for row in batch.to_pylist():
                    number += 1
                    yield number, json.dumps({k: v for k, v in row.items() if v is not None})
            return
        with filesystem.open_input_stream(path) as f:
            number, rest = 0, b""
            while chunk := f.read(1 << 20):
                *lines, rest = (rest + chunk).split(b"\n")
                for raw in lines:
                    number += 1
                    if raw.strip():
                        yield number, raw.decode("utf-8", errors="replace")
            if rest.strip():
                yield number + 1, rest.decode("utf-8", errors="replace")
    except (FileNotFoundError, OSError) as e:
        raise BatchJobError(f"{in_path}: cannot read the input ({e})") from None


class JsonlOutput:
    """One local JSONL file, appended and flushed per block (as `jaxgen batch` writes it)."""

    def __init__(self, path: str):
        check_output(path)
        self.path = path
        self.done = done_ids(path)  # a torn last line is cut off first
        self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())

    def write(self, records: list[str]) -> None:
        for text in records:
            self.file.write(text + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class ParquetOutput:
    """A directory of Parquet part files (local or any pyarrow.fs URI), one per block, each
    written whole: columns id, custom_id (as JSON text), response (JSON text), error."""

    def __init__(self, path: str):
        import pyarrow.dataset as ds

        self.filesystem, self.path = _filesystem(path)
        self.filesystem.create_dir(self.path, recursive=True)
        self.done = set()
        parts = ds.dataset(self.path, filesystem=self.filesystem, format="parquet")
        for batch in parts.to_batches(columns=["custom_id"]) if parts.files else ():
            self.done.update(json.loads(x) for x in batch.column(0).to_pylist())

    def write(self, records: list[str]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not records:
            return
        rows = [json.loads(r) for r in records]
        table = pa.table(
            {
                "id": [r["id"] for r in rows],
                "custom_id": [json.dumps(r["custom_id"]) for r in rows],
                "response": [json.dumps(r["response"]) for r in rows],
                "metrics": [json.dumps(r["metrics"]) for r in rows],
                "error": pa.array([None] * len(rows), pa.string()),
            }
        )
        name = f"part-{uuid.uuid4().hex}.parquet"
        tmp = f"{self.path}/.{name}.tmp"  # a killed job leaves no half-written part behind
        pq.write_table(table, tmp, filesystem=self.filesystem)
        self.filesystem.move(tmp, f"{self.path}/{name}")

    def close(self) -> None:
        pass


def open_output(out_path: str):
    if is_parquet(out_path):
        return ParquetOutput(out_path)
    if "://" in out_path:
        raise BatchJobError(
            f"{out_path}: JSONL output is a local file; write Parquet to object storage "
            "(an output path ending in .parquet)"
        )
    return JsonlOutput(out_path)


# ------------------------------------------------------------------------------------------
# The job
# ------------------------------------------------------------------------------------------
def run_ray_batch(
    model,
    in_path: str,
    out_path: str,
    defaults: SamplingParams | None = None,
    *,
    llm_options: dict | None = None,
    replicas: int = 1,
    batch_size: int = 64,
    cpus_per_replica: float = 1,
    gpus_per_replica: float = 0,
    max_retries: int = 3,
    address: str | None = None,
    errors_path: str | None = None,
    seed: int | None = 0,
    raw: bool = False,
    model_name: str = "default",
    tool_call_parser: str | None = None,
) -> dict:
    """Runs (or resumes) a batch job over a Ray cluster (see the module docstring).

    Args:
      model: what each replica loads (`LLM(model, **llm_options)`): a path every node can
        read, or None for the embedded model.
      replicas: actors in the pool, one engine each, with `cpus_per_replica` CPUs and
        `gpus_per_replica` GPUs (Ray places them; `llm_options["mesh"]` spans those GPUs).
      batch_size: lines per block: the unit fed to a replica, retried after a fault, and
        written at once.
      max_retries: restarts of a replica that died and retries of its block (Ray's
        max_restarts / max_task_retries).
      address: the cluster to join ("auto", "ray://HOST:10001", ...); None: the one this
        process already joined, else a new local one.
    Returns:
      the summary of `run_batch`, plus duplicates dropped, replica restarts seen and rows/s
      and tokens/s per replica.
    """
    ray = import_ray()
    if replicas < 1 or batch_size < 1 or max_retries < 0:
        raise BatchJobError(
            f"replicas ({replicas}) and batch_size ({batch_size}) must be >= 1 and "
            f"max_retries ({max_retries}) >= 0"
        )
    if "://" not in in_path:
        check_input(in_path)
    output = open_output(out_path)
    errors_path = errors_path or out_path.rstrip("/") + ".errors.jsonl"
    skipped, blocks = _blocks(in_path, output.done, batch_size)
    job = JobOptions(defaults or SamplingParams(), seed, raw, model_name, tool_call_parser)
    if not ray.is_initialized():
        with _environment(LOCAL_CLUSTER_CONFIG):
            ray.init(address=address, include_dashboard=False)
    t0 = time.perf_counter()
    stats, per_replica = JobStats(), {}
    written, duplicates, bad = set(output.done), 0, 0
    with open(errors_path, "w", encoding="utf-8") as errors:
        if blocks:
            with warnings.catch_warnings():
                # Ray 2.60 deprecates actor options passed as keywords (removal: 2.64) and
                # names no replacement for max_restarts / max_task_retries yet.
                warnings.filterwarnings("ignore", "`ray_remote_args` is deprecated")
                results = ray.data.from_arrow(blocks).map_batches(
                    Replica,
                    fn_constructor_args=(model, llm_options or {}, job),
                    batch_size=None,  # a block is one batch
                    batch_format="pyarrow",
                    # Two blocks in flight per replica, run by two threads on one engine
                    # (EngineDriver): the next block is admitted while one drains its tail.
                    compute=ray.data.ActorPoolStrategy(
                        size=replicas,
                        max_concurrent_calls_per_actor=BLOCKS_IN_FLIGHT,
                        enable_true_multi_threading=True,
                    ),
                    num_cpus=cpus_per_replica,
                    num_gpus=gpus_per_replica or None,
                    max_restarts=max_retries,
                    max_task_retries=max_retries,
                )
            for batch in results.iter_batches(batch_size=None, batch_format="pyarrow"):
                records = []
                for row in batch.to_pylist():
                    if row["error"] is not None:
                        errors.write(row["error"] + "\n")
                        bad += 1
                        continue
                    custom_id = json.loads(row["custom_id"])
                    if custom_id in written:
                        duplicates += 1
                        continue
                    written.add(custom_id)
                    records.append(row["output"])
                    stats.add(
                        row["tokens"],
                        row["empty"],
                        json.loads(row["reasons"]),
                        row["ttft"],
                        row["tpot"],
                    )
                    mine = per_replica.setdefault(row["replica"], [0, 0, {}])
                    mine[0] += 1
                    mine[1] += row["tokens"]
                    mine[2][row["block"]] = (row["block_start"], row["block_end"])
                output.write(records)
                errors.flush()
    output.close()
    elapsed = time.perf_counter() - t0
    return {
        "output": out_path,
        "errors_file": errors_path,
        "done": stats.done,
        "skipped_already_done": skipped,
        "bad_lines": bad,
        "duplicates_dropped": duplicates,
        **stats.summary(elapsed),
        "replicas": {
            name: _replica_summary(rows, tokens, _covered(blocks.values()))
            for name, (rows, tokens, blocks) in per_replica.items()
        },
        "ray_version": ray.__version__,
    }


@contextlib.contextmanager
def _environment(variables: dict):
    """`variables` set (where the caller has not set them) while the block runs."""
    added = {k: v for k, v in variables.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def _replica_summary(rows: int, tokens: int, busy: float) -> dict:
    return {
        "rows": rows,
        "output_tokens": tokens,
        "busy_s": busy,
        "rows_per_s": rows / busy,
        "tokens_per_s": tokens / busy,
    }


def _covered(intervals) -> float:
    """Seconds covered by the union of (start, end) intervals: a replica's busy time, with
    blocks in flight together counted once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def replica_pids() -> list[int]:
    """Processes of this machine running a replica actor (Ray titles a worker process after
    its stage, e.g. ``ray::MapWorker(MapBatches(Replica))``): what a fault test kills."""
    import psutil

    pids = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or [])
        if cmdline.startswith("ray::") and "Replica" in cmdline:
            pids.append(p.info["pid"])
    return pids


def _blocks(in_path: str, done: set, batch_size: int):
    """(lines skipped as already done, pyarrow tables of `batch_size` numbered lines)."""
    import pyarrow as pa

    skipped, numbers, texts, blocks = 0, [], [], []
    for number, text in read_lines(in_path):
        if line_id(number, text) in done:
            skipped += 1
            continue
        numbers.append(number)
        texts.append(text)
        if len(numbers) == batch_size:
            blocks.append(pa.table({"line": numbers, "text": texts}))
            numbers, texts = [], []
    if numbers:
        blocks.append(pa.table({"line": numbers, "text": texts}))
    return skipped, blocks
