"""What a GGUF file holds, and whether Hugging Face transformers reads it back.

transformers dequantizes a GGUF file on load, so it is the outside reference that
carpool's GGUF loader is compared with; a fixture that transformers cannot load
(or whose tokenizer it rebuilds differently) would be no reference at all.
`load_with_transformers` needs `accelerate` installed (transformers' GGUF path
requires it).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

SAMPLE_TEXT = "def add(a, b):\n    return a + b  # 42\n\nclass Stack:\n    pass\n"
PROMPT_TEXT = "def add(a, b):\n"


def tensor_types(path: str | Path) -> dict[str, str]:
    """Each tensor's GGML type name, in file order, as `gguf.GGUFReader` reads it."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {t.name: t.tensor_type.name for t in reader.tensors}


def type_summary(types: dict[str, str]) -> str:
    """'Q4_K x10, Q6_K x3, F32 x5': how many tensors of each type."""
    counts = Counter(types.values())
    return ", ".join(f"{name} x{n}" for name, n in sorted(counts.items()))


def metadata(path: str | Path, keys: tuple[str, ...] = (
        "general.architecture", "general.name", "general.file_type",
        "tokenizer.ggml.model", "tokenizer.ggml.pre")) -> dict:
    import gguf

    reader = gguf.GGUFReader(str(path))
    out = {}
    for key in keys:
        field = reader.get_field(key)
        if field is not None:
            out[key] = field.contents()
    return out


def load_with_transformers(path: str | Path):
    """(model, tokenizer) from the GGUF file alone, as transformers dequantizes it."""
    import transformers

    path = Path(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.eval(), tokenizer


def transformers_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                             do_sample=False, min_new_tokens=max_new_tokens)
    return out[0, len(prompt_ids):].tolist()


def check_with_transformers(path: str | Path, hf_dir: str | Path,
                            max_new_tokens: int = 16) -> dict:
    """Load `path` with transformers; its tokenizer must equal the source checkpoint's.

    Returns the model class, the prompt's ids and transformers' greedy tokens.
    """
    import transformers

    model, tokenizer = load_with_transformers(path)
    source_tokenizer = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    ids = tokenizer(SAMPLE_TEXT, add_special_tokens=False).input_ids
    want = source_tokenizer(SAMPLE_TEXT, add_special_tokens=False).input_ids
    if ids != want:
        raise AssertionError(f"{path}: transformers' GGUF tokenizer gives {ids}, "
                             f"the checkpoint's gives {want}")
    prompt = source_tokenizer(PROMPT_TEXT, add_special_tokens=False).input_ids
    return {"model_class": type(model).__name__, "prompt_ids": prompt,
            "greedy": transformers_greedy(model, prompt, max_new_tokens)}


def gguf_package_requantizes(quantized: str | Path, f32: str | Path) -> tuple[int, int]:
    """(tensors the gguf package quantizes to the same bytes, tensors it can quantize).

    For each tensor of `quantized` whose type the gguf package can write (Q8_0, Q4_0,
    F16 among them), quantize the same tensor of `f32` (the float file it was made
    from) with `gguf.quants.quantize` and compare bytes. Equal counts mean a test can
    write llama.cpp's file of that type itself.
    """
    import gguf
    import numpy as np

    source = {t.name: t for t in gguf.GGUFReader(str(f32)).tensors}
    same = total = 0
    for t in gguf.GGUFReader(str(quantized)).tensors:
        if t.tensor_type in (gguf.GGMLQuantizationType.F32,) or not _writable(t.tensor_type):
            continue
        total += 1
        mine = gguf.quants.quantize(np.asarray(source[t.name].data, dtype=np.float32),
                                    t.tensor_type)
        same += bool(np.array_equal(mine.view(np.uint8).reshape(-1),
                                    np.asarray(t.data).view(np.uint8).reshape(-1)))
    return same, total


def _writable(qtype) -> bool:
    import gguf
    import numpy as np

    try:
        gguf.quants.quantize(np.zeros((1, 256), dtype=np.float32), qtype)
        return True
    except NotImplementedError:
        return False
