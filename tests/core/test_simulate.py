"""`carpool simulate`: the built-in scenarios give exactly the figures in issue 2."""

import json

import pytest

from carpool.cli import main
from carpool.sim.simulator import SimSettings, simulate
from carpool.sim.workload import LinearCostModel, classic_5, load_workload, mix_100


def run_json(capsys, *argv) -> dict:
    assert main(["simulate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_classic_5_numbers(capsys):
    result = run_json(capsys, "--scenario", "classic-5")
    assert set(result) == {"static", "continuous"}
    static, continuous = result["static"], result["continuous"]
    for summary in (static, continuous):
        assert {"total_s", "mean_latency_s", "throughput_tok_s", "requests"} <= set(summary)
    assert {rid: r["finish_s"] for rid, r in static["requests"].items()} == \
        {"A": 5.0, "B": 1.0, "C": 2.5, "D": 10.0, "E": 11.5}
    assert static["mean_latency_s"] == 6.0
    assert continuous["requests"]["E"]["finish_s"] == 2.5  # takes B's seat at step 20
    assert {rid: r["finish_s"] for rid, r in continuous["requests"].items()} == \
        {"A": 5.0, "B": 1.0, "C": 2.5, "D": 10.0, "E": 2.5}
    assert continuous["mean_latency_s"] == 4.2


def test_mix_100_numbers(capsys):
    assert main(["simulate", "--scenario", "mix-100"]) == 0
    text = capsys.readouterr().out
    assert "total 250.0 s" in text and "throughput 44.0 tok/s" in text
    assert "total 142.0 s" in text
    assert "ideal bound (every slot busy every step): 137.5 s" in text
    assert "1.76x faster" in text
    result = run_json(capsys, "--scenario", "mix-100")
    assert result["static"]["total_s"] == 250.0 and result["static"]["throughput_tok_s"] == 44.0
    assert result["continuous"]["total_s"] == 142.0
    assert len(result["continuous"]["requests"]) == 100


def test_text_output_has_finish_times_and_a_slot_timeline(capsys):
    assert main(["simulate", "--scenario", "classic-5", "--timeline-rows", "23"]) == 0
    text = capsys.readouterr().out
    assert "A 5.0   B 1.0   C 2.5   D 10.0   E 11.5" in text
    assert "mean latency 6.0 s" in text and "mean latency 4.2 s" in text
    static_rows = text.split("== continuous ==")[0]
    assert "   10.00 | E   .   .   .  " in static_rows  # E alone: three idle slots
    assert "    5.00 | x   x   x   D  " in static_rows  # ended members keep their seats


def test_static_pays_for_padding_through_the_cost_model():
    scenario = classic_5()
    flat = simulate("static", scenario)
    per_token = simulate("static", scenario.__class__(
        scenario.name, scenario.requests, 4, LinearCostModel(0.05, 0.001)))
    # 230 steps; the static batch computes 4 rows a step (ended members as padding)
    # except the last 30 steps where E runs alone: 200 * 4 + 30 tokens.
    assert per_token.total_s == pytest.approx(flat.total_s + 0.001 * (200 * 4 + 30))
    assert flat.num_padding_tokens == 200 * 4 - 370


def test_preemption_shows_up_with_a_small_pool():
    settings = SimSettings(num_blocks=30, block_size=16)
    result = simulate("continuous", mix_100(), settings)
    assert result.num_preemptions > 0
    assert result.num_output_tokens == 11_000  # every request still finishes whole


def test_workload_file_and_cost_flags(tmp_path, capsys):
    path = tmp_path / "w.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_tokens": 10, "output_tokens": 3}\n'
                    '\n{"id": "late", "arrival_s": 1.0, "prompt_tokens": 4, "output_tokens": 2}\n')
    result = run_json(capsys, "--workload", str(path), "--cost-a", "0.1", "--cost-b", "0.01",
                      "--slots", "2")
    # r1: prefill step 0.1 + 10 * 0.01, then 2 decode steps of 0.11 -> 0.42 s
    assert result["continuous"]["requests"]["r1"]["finish_s"] == 0.42
    # "late" arrives at 1.0 to an idle engine: 0.14 + 0.11
    assert result["continuous"]["requests"]["late"]["finish_s"] == 1.25


@pytest.mark.parametrize("line, message", [
    ('{"arrival_s": 0, "prompt_tokens": 0, "output_tokens": 3}', "num_prompt_tokens"),
    ('{"arrival_s": 0, "output_tokens": 3}', "prompt_tokens"),
    ('not json', "w.jsonl:1"),
])
def test_bad_workload_lines_are_named(tmp_path, line, message):
    path = tmp_path / "w.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=message):
        load_workload(path, 4, LinearCostModel(0.05))
    with pytest.raises(SystemExit, match=message):
        main(["simulate", "--workload", str(path)])


def test_plot_is_written(tmp_path, capsys):
    path = tmp_path / "timeline.png"
    assert main(["simulate", "--scenario", "classic-5", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"timeline plot written to {path}" in capsys.readouterr().out
