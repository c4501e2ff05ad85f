"""`carpool generate`: prints each prompt's completion and reports bad input as exit code 2."""

from __future__ import annotations

from carpool import LLM, SamplingParams
from carpool.cli import main


def test_generate_prints_the_greedy_completion(separated_checkpoint, capsys):
    model = str(separated_checkpoint("llama"))
    args = [model, "--prompt", "def f(x):", "--prompt", "import os", "--max-tokens", "6",
            "--temperature", "0", "--ignore-eos", "--num-kv-blocks", "32", "--device", "cpu",
            "--dtype", "float32", "--no-tqdm"]
    assert main(["generate", *args]) == 0
    printed = capsys.readouterr().out
    llm = LLM(model, dtype="float32", device="cpu", num_kv_blocks=32)
    expected = llm.generate(["def f(x):", "import os"], SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    for i, out in enumerate(expected):
        assert f"=== prompt {i}: {out.prompt!r}\n{out.outputs[0].text}\n" in printed
    assert printed.count("--- 6 tokens, finish_reason=length") == 2


def test_generate_reports_bad_input(separated_checkpoint, capsys):
    model = str(separated_checkpoint("llama"))
    assert main(["generate", model, "--prompt", "x", "--temperature", "5",
                 "--num-kv-blocks", "8", "--no-tqdm"]) == 2
    assert "temperature must be in [0.0, 2.0]" in capsys.readouterr().err
    assert main(["generate", "/no/such/model", "--prompt", "x", "--no-tqdm"]) == 2
    assert "/no/such/model" in capsys.readouterr().err
