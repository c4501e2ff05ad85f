"""The shipped default model: complete, loadable as a plain HF folder, and actually trained."""

from __future__ import annotations

import dataclasses

import ast
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from carpool.default_model_path import default_model_path

ROOT = Path(__file__).resolve().parent.parent
SHIPPED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "chat_template.jinja", "training_metrics.json")
MAX_FOLDER_BYTES = 30 * 1024 * 1024


@pytest.fixture(scope="module")
def folder() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def tokenizer(folder):
    return transformers.AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def model(folder):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def metrics(folder) -> dict:
    return json.loads((folder / "training_metrics.json").read_text())


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location(
        "train_default_model", ROOT / "scripts" / "train_default_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def split(script) -> tuple[list[Path], list[Path]]:
    return script.corpus_split()


def test_folder_has_every_file_and_fits_the_size_budget(folder):
    assert folder.is_dir() and folder.name == "default_model"
    missing = [name for name in SHIPPED_FILES if not (folder / name).is_file()]
    assert missing == []
    assert sum(p.stat().st_size for p in folder.iterdir()) < MAX_FOLDER_BYTES


def test_config_is_a_llama_whose_ids_match_the_tokenizer(folder, tokenizer, metrics):
    config = json.loads((folder / "config.json").read_text())
    generation = json.loads((folder / "generation_config.json").read_text())
    eos_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["eos_token_id"] == generation["eos_token_id"] == tokenizer.eos_token_id == eos_id
    assert config["vocab_size"] == len(tokenizer) == metrics["config"]["vocab_size"]
    assert config["max_position_embeddings"] == metrics["config"]["context_len"]
    assert tokenizer.model_max_length == config["max_position_embeddings"]
    assert config["num_hidden_layers"] == metrics["config"]["num_layers"]


def test_recorded_parameter_count_matches_the_weights(folder, metrics):
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        num_params = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    assert num_params == metrics["num_params"]


def test_special_tokens_are_single_ids_and_python_round_trips(tokenizer):
    for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert len(tokenizer(token, add_special_tokens=False).input_ids) == 1
    source = "class Stack:\n    def push(self, item):\n\tself.items.append(item)  # é\n"
    ids = tokenizer(source, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == source


def test_chat_template_renders(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_recorded_heldout_loss_clearly_beats_the_unigram_baseline(metrics):
    assert metrics["heldout_loss_nats"] < metrics["unigram_baseline_nats"] - 1.5
    first, last = metrics["train_loss_history"][0], metrics["train_loss_history"][-1]
    assert last["train_loss"] < first["train_loss"]


def test_shipped_weights_beat_the_unigram_baseline_on_heldout_text(script, split, tokenizer,
                                                                    model, metrics):
    _, heldout_files = split
    context_len = model.config.max_position_embeddings
    heldout = script.chunks(script.token_stream(tokenizer, heldout_files), context_len)
    loss = script.heldout_loss(model, heldout[:4])
    assert loss < metrics["unigram_baseline_nats"] - 1.5


def test_corpus_split_is_disjoint_sorted_and_skips_tests(script, split):
    train, heldout = split
    assert heldout and len(train) > 10 * len(heldout)
    assert not set(train) & set(heldout)
    root = script.stdlib_root()
    relative = [path.relative_to(root).as_posix() for path in train]
    assert relative == sorted(relative)
    for path in train + heldout:
        assert not {"test", "tests", "idlelib", "site-packages"} & set(
            path.relative_to(root).parts[:-1])


SOURCE = '''"""Module docstring."""
import os
X = 1

# helper, with a comment above it
@decorator
def f(a):
    return a


class C(Base):
    """Doc."""

    def one(self):
        return 1

    def two(self):
        return 2
if X: Y = 2
'''


def test_documents_cut_a_file_at_top_level_statements(script):
    docs = script.documents(SOURCE)
    assert docs == [
        '"""Module docstring."""\nimport os\nX = 1\n',
        "# helper, with a comment above it\n@decorator\ndef f(a):\n    return a\n",
        'class C(Base):\n    """Doc."""\n\n    def one(self):\n        return 1\n\n'
        "    def two(self):\n        return 2\n",
        "if X: Y = 2\n",
    ]


def test_a_long_class_is_cut_into_pieces_that_each_parse_under_its_header(script):
    methods = "".join(f"    def m{i}(self):\n        return {i}\n\n" for i in range(40))
    source = "@dataclass\nclass Long(Base):\n    x = 1\n\n" + methods
    docs = script.documents(source)
    assert len(docs) > 2 and docs[0].startswith("@dataclass\nclass Long(Base):\n    x = 1\n")
    assert all(doc.startswith("class Long(Base):\n    def ") for doc in docs[1:])
    for doc in docs:
        ast.parse(doc)
        assert len(doc.splitlines()) <= script.MAX_CLASS_DOC_LINES + 1
    bodies = [doc.split("\n", 1)[1] for doc in docs]  # every method exactly once
    assert "".join(bodies).count("    def m") == 40


def test_a_file_that_does_not_parse_is_one_document(script):
    assert script.documents("def broken(:\n    pass\n") == ["def broken(:\n    pass\n"]


def test_greedy_completion_looks_like_python(tokenizer, model):
    prompt = "def read_file(path):"  # (`def fibonacci(n):` gets a body of comments)
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    out = model.generate(ids, max_new_tokens=64, do_sample=False,
                         attention_mask=torch.ones_like(ids))
    text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert text.startswith("\n    ")  # an indented function body
    words = set(text.replace("(", " ").replace(":", " ").split())
    assert words & {"def", "return", "if", "for", "self", "import", "class", '"""'}


STOPPING_PROMPTS = ("def fibonacci(n):", "import os\n", "class Stack:", "def add(a, b):",
                    "def is_prime(n):", "def read_file(path):", "import sys\n", "def main():")
MAX_STOP_TOKENS = 128
# Measured with the shipped generation_config (repetition_penalty 1.1): 7 of 8 stop within
# 128 tokens (2 of 8 with plain greedy). A margin of 2 for float rounding on other CPUs.
MIN_STOPPED = 5


def test_llm_with_no_model_stops_typical_prompts_on_the_end_token():
    """`LLM()` serves the shipped folder, and greedy completions end by themselves."""
    from carpool import LLM

    llm = LLM()
    defaults = llm.get_default_sampling_params()
    assert defaults.repetition_penalty == 1.1  # from the shipped generation_config.json
    params = dataclasses.replace(defaults, max_tokens=MAX_STOP_TOKENS, temperature=0)
    outputs = llm.generate(list(STOPPING_PROMPTS), params, use_tqdm=False)
    finished = {o.prompt: o.outputs[0].finish_reason for o in outputs}
    stopped = [prompt for prompt, reason in finished.items() if reason == "stop"]
    assert len(stopped) >= MIN_STOPPED, finished
    eos_id = llm.get_tokenizer().eos_token_id
    for output in outputs:
        completion = output.outputs[0]
        assert eos_id not in completion.token_ids[:-1]  # nothing generated after the end
