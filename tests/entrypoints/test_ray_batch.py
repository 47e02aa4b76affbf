"""Batch jobs on Ray Data: a local head on loopback, two replica actors on the CPU, a tiny random
model saved as a checkpoint. Greedy rows equal LLM.generate; a resumed job and a job whose
replica is killed write every id exactly once; a bad line goes to the errors file."""

import json
import os
import signal
import threading
import time

import pytest

from jaxgen import LLM, SamplingParams
from jaxgen.model.loading import save_checkpoint

ray = pytest.importorskip("ray", reason="the ray extra: pip install 'jaxgen[ray]'")

from jaxgen.entrypoints.ray_batch import replica_pids, run_ray_batch  # noqa: E402

# The two step programs of batch-invariant mode compile ahead of time and are kept in the
# executable cache: replicas started later (tests, restarts) load them instead of compiling.
OPTIONS = dict(
    max_model_len=256,
    max_num_seqs=4,
    max_num_batched_tokens=128,
    compile_buckets=["prefill:64", "decode:1@128"],
    seed=0,
)
PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def cluster():
    ray.init(
        num_cpus=4,  # two replicas of one CPU each, and room for Ray Data's own tasks
        include_dashboard=False,
        object_store_memory=80 * 1024**2,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def checkpoint(tiny, tmp_path_factory):
    cfg, params, tokenizer = tiny
    path = str(tmp_path_factory.mktemp("tiny-ckpt"))
    save_checkpoint(path, cfg, params, tokenizer)
    return path


def write_jobs(path, n, bad_at=None):
    with open(path, "w") as f:
        for i in range(n):
            if i == bad_at:
                f.write("{not json\n")
            f.write(json.dumps({"id": f"q{i}", "prompt": f"Tell me about {i} and {i * 7}."}) + "\n")


def rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def job(checkpoint, jobs, out, **kwargs):
    kwargs.setdefault("replicas", 2)
    kwargs.setdefault("batch_size", 4)
    return run_ray_batch(
        checkpoint,
        str(jobs),
        str(out),
        PARAMS,
        llm_options=dict(OPTIONS, batch_invariant=True),
        seed=3,
        **kwargs,
    )


def test_greedy_rows_equal_generate_and_a_bad_line_is_reported(cluster, checkpoint, tmp_path):
    jobs, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jobs(jobs, 14, bad_at=5)
    summary = job(checkpoint, jobs, out)
    assert summary["done"] == 14 and summary["bad_lines"] == 1
    assert summary["duplicates_dropped"] == 0
    with open(summary["errors_file"]) as f:
        (error,) = [json.loads(x) for x in f]
    assert error["line"] == 6 and "invalid JSON" in error["error"]
    got = {r["custom_id"]: r["response"]["body"]["choices"][0] for r in rows(out)}
    assert sorted(got) == sorted(f"q{i}" for i in range(14))
    llm = LLM(checkpoint, **OPTIONS, batch_invariant=True)
    prompts = [
        llm.apply_chat_template([{"role": "user", "content": f"Tell me about {i} and {i * 7}."}])
        for i in range(14)
    ]
    for i, want in enumerate(llm.generate(prompts, PARAMS)):
        assert got[f"q{i}"]["token_ids"] == want.outputs[0].token_ids, f"q{i}"


def test_resume_writes_each_remaining_id_once(cluster, checkpoint, tmp_path):
    jobs, full, out = tmp_path / "in.jsonl", tmp_path / "full.jsonl", tmp_path / "out.jsonl"
    write_jobs(jobs, 12)
    job(checkpoint, jobs, full, replicas=1)
    # A crash after 5 rows, the sixth torn mid-write.
    lines = full.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:5]) + lines[5][:40])
    summary = job(checkpoint, jobs, out)
    assert summary["skipped_already_done"] == 5 and summary["done"] == 7
    ids = [r["custom_id"] for r in rows(out)]
    assert sorted(ids) == sorted(f"q{i}" for i in range(12))
    a = {r["custom_id"]: r["response"]["body"]["choices"] for r in rows(full)}
    b = {r["custom_id"]: r["response"]["body"]["choices"] for r in rows(out)}
    assert a == b  # batch-invariant: 1 replica vs 2, whole vs resumed: tokens and logprobs


def test_parquet_in_and_out(cluster, checkpoint, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [{"id": f"p{i}", "prompt": f"Count to {i}."} for i in range(6)]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "in.parquet")
    out = tmp_path / "out.parquet"
    summary = job(checkpoint, tmp_path / "in.parquet", out, batch_size=3)
    assert summary["done"] == 6
    table = pq.read_table(out)
    assert sorted(json.loads(x) for x in table.column("custom_id").to_pylist()) == [
        f"p{i}" for i in range(6)
    ]
    again = job(checkpoint, tmp_path / "in.parquet", out)
    assert again["skipped_already_done"] == 6 and again["done"] == 0


@pytest.mark.slow
def test_killed_replica_still_writes_every_id_once(cluster, checkpoint, tmp_path):
    jobs, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    n = 32
    write_jobs(jobs, n)
    result = {}
    runner = threading.Thread(
        target=lambda: result.update(job(checkpoint, jobs, out, batch_size=2, max_retries=2))
    )
    runner.start()
    deadline = time.time() + 300
    while time.time() < deadline and not (out.exists() and out.read_text().count("\n") >= 2):
        time.sleep(0.1)
    pids = replica_pids()
    assert pids, "no replica process found"
    os.kill(pids[0], signal.SIGKILL)  # mid-job: the other blocks are still to come
    runner.join(timeout=600)
    assert not runner.is_alive()
    ids = [r["custom_id"] for r in rows(out)]
    assert len(ids) == n and len(set(ids)) == n  # count n, duplicates 0
    assert set(ids) == {f"q{i}" for i in range(n)}  # missing 0
    assert result["done"] == n
    clean = tmp_path / "clean.jsonl"
    job(checkpoint, jobs, clean, replicas=1, batch_size=8)
    a = {r["custom_id"]: r["response"]["body"]["choices"] for r in rows(clean)}
    b = {r["custom_id"]: r["response"]["body"]["choices"] for r in rows(out)}
    assert a == b  # across the kill and retry: the same tokens and logprobs


def test_a_cluster_it_starts_keeps_no_idle_worker(monkeypatch, tmp_path):
    """A job that starts its own local cluster asks Ray to keep no idle worker process (an idle
    one polls every 10 ms beside the engine all job long), keeps a caller's own setting, and
    leaves the environment as it found it."""
    from jaxgen.entrypoints import ray_batch

    seen = {}

    class Started(Exception):
        pass

    def init(**kwargs):
        seen.update({k: os.environ.get(k) for k in ray_batch.LOCAL_CLUSTER_CONFIG})
        raise Started

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setenv("RAY_enable_worker_prestart", "1")  # the caller's own choice
    for name in ("RAY_prestart_worker_first_driver", "RAY_num_workers_soft_limit"):
        monkeypatch.delenv(name, raising=False)
    write_jobs(tmp_path / "in.jsonl", 2)
    with pytest.raises(Started):
        run_ray_batch(None, str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"))
    assert seen == {
        "RAY_prestart_worker_first_driver": "0",
        "RAY_enable_worker_prestart": "1",
        "RAY_num_workers_soft_limit": "0",
    }
    assert "RAY_prestart_worker_first_driver" not in os.environ
    assert os.environ["RAY_enable_worker_prestart"] == "1"
