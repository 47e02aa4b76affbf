"""A batch job on a dp=2,tp=2 mesh of host devices gives the one-device job's outputs."""

from jaxgen import SamplingParams
from tests.entrypoints.test_batch import read_out, write_jobs


def test_job_on_a_dp2_tp2_mesh_equals_one_device(llm, default_model, default_tokenizer, tmp_path):
    from jaxgen import LLM

    jobs = tmp_path / "in.jsonl"
    write_jobs(jobs, n=8)
    params = SamplingParams(temperature=0, max_tokens=6)
    single = tmp_path / "single.jsonl"
    llm.generate_file(str(jobs), str(single), params, seed=3, progress=False)
    cfg, weights = default_model
    meshed = LLM.from_parts(
        cfg, weights, default_tokenizer, mesh="dp=2,tp=2", max_num_seqs=4, max_model_len=256
    )
    out = tmp_path / "mesh.jsonl"
    summary = meshed.generate_file(str(jobs), str(out), params, seed=3, progress=False)
    assert summary["done"] == 8
    a, b = read_out(single), read_out(out)
    assert set(a) == set(b) and len(b) == 8
    for k in a:
        assert a[k]["response"]["body"]["choices"] == b[k]["response"]["body"]["choices"]
