"""A quantized model holds each weight once: a GGUF load keeps none of the file's pages
resident, and once the platform packed a linear's parts its canonical tensors are freed (a
second copy of every weight doubled the model's memory). The packed model still answers as
the reference does."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch

from carpool import kernels as cpu_kernels
from carpool.models.quant.gguf_file import GgufFile
from carpool.models.quant.gguf_loader import load_gguf_model
from carpool.models.quant.linear import QuantLinear
from carpool.platform import CpuPlatform

FIXTURE = Path(__file__).parents[1] / "fixtures" / "gguf" / "tiny-qwen2-Q4_K_M.gguf"


def _rss_file_kib() -> int:
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("RssFile"))
               .split()[1])


def _load(path: Path) -> torch.nn.Module:
    return load_gguf_model(path, GgufFile(path).model_config(), torch.float32,
                           torch.device("cpu"))


def test_packed_linears_free_their_canonical_parts():
    if cpu_kernels.load() is None:
        pytest.skip("packing needs the compiled C++ kernels")
    model = _load(FIXTURE)
    reference = _load(FIXTURE)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    canonical = [weakref.ref(part.qweight) for linear in linears for part in linear.parts
                 if hasattr(part, "qweight")]
    assert canonical
    CpuPlatform(kernels=True).prepare_model(model)
    gc.collect()
    alive = [ref for ref in canonical if ref() is not None]
    # the tied embedding's rows stay (it looks tokens up in them); nothing else may
    embedding = model.model.embed_tokens.weight_q.qweight
    assert all(ref() is embedding for ref in alive), f"{len(alive)} canonical weights alive"
    assert all(linear.parts == [] for linear in linears)
    x = torch.randn(3, linears[0].in_features)
    ref_linear = next(m for m in reference.modules() if isinstance(m, QuantLinear))
    torch.testing.assert_close(linears[0](x), ref_linear(x), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/self/status")
def test_gguf_load_leaves_no_file_pages_resident(tmp_path):
    # a private copy, so no other test's mapping of the same file shares its pages
    source = FIXTURE.parent / "carpool-default-Q4_K_M.gguf"
    copy = tmp_path / source.name
    copy.write_bytes(source.read_bytes())
    before = _rss_file_kib()
    file = GgufFile(copy)
    for tensor in file.reader.tensors:
        tensor.data.sum()  # touch every page, as a load's conversions do
    touched = _rss_file_kib() - before
    file.release_pages()
    released = _rss_file_kib() - before
    size_kib = copy.stat().st_size // 1024
    assert touched > size_kib // 2, (touched, size_kib)
    assert released < size_kib // 4, (released, size_kib)


def _parts(model: torch.nn.Module) -> list:
    return [part for m in model.modules() if isinstance(m, QuantLinear) for part in m.parts
            if hasattr(part, "qweight")]


@pytest.mark.parametrize(("qtype", "bits"), [("Q5_0", 5), ("Q8_0", 8), ("Q4_0", 4)])
def test_packing_reads_the_fewest_bytes_that_hold_the_weight(make_checkpoint, tmp_path, qtype,
                                                             bits):
    """Q5_0's q (-16..15) is held as int8 in the canonical form; the kernel reads it packed in
    five bits. Q8_0's full int8 range stays in eight. These types' scales (and Q4_0's mins, -8
    times its scale) are float16 in the file, so their packed headers are float16 too."""
    from carpool.platform.cpu_quant import f16_header, packed_bits
    from carpool.testing.gguf_writer import write_gguf

    file = write_gguf(make_checkpoint("qwen2"), tmp_path / f"m-{qtype}.gguf", qtype)
    parts = _parts(_load(file))
    assert parts and {packed_bits(part) for part in parts} == {bits}
    assert all(f16_header(part) for part in parts)


def test_q6_k_packs_as_six_bits_and_q4_k_as_four():
    """Q6_K's q lies in -32..31: packed as bits 6 (its pairs one table lookup each), Q4_K's
    nibbles in 4."""
    from carpool.platform.cpu_quant import packed_bits

    kinds = {part.kind: packed_bits(part) for part in _parts(_load(FIXTURE))}
    assert kinds.get("Q6_K") == 6 and kinds.get("Q4_K") == 4


def test_k_quant_scales_keep_float32_headers():
    """Q4_K's and Q6_K's scales are a float16 times a 6- or 8-bit integer: not float16 in
    general, so they stay float32 (exact) in the packed header."""
    from carpool.platform.cpu_quant import f16_header

    kinds = {part.kind: f16_header(part) for part in _parts(_load(FIXTURE))}
    assert kinds.get("Q4_K") is False and kinds.get("Q6_K") is False


def test_the_loader_hands_each_linear_to_the_platform_as_it_is_read():
    """The platform packs each quantized linear (and frees its canonical parts) before the
    loader reads the next, so a load never holds every canonical weight at once; the model's
    preparation afterwards packs nothing twice, and the model answers as the reference."""
    if cpu_kernels.load() is None:
        pytest.skip("packing needs the compiled C++ kernels")
    config = GgufFile(FIXTURE).model_config()
    platform = CpuPlatform(kernels=True)
    platform.decide_route(torch.float32, config.head_dim, config.sliding_window)
    packer = platform.quant_linear_packer(torch.float32)
    assert packer is not None
    handed = []

    def prepare(linear: QuantLinear) -> None:
        assert all(earlier.parts == [] for earlier in handed)  # one canonical copy at a time
        packer(linear)
        handed.append(linear)

    model = load_gguf_model(FIXTURE, config, torch.float32, torch.device("cpu"),
                            prepare_linear=prepare)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert {id(m) for m in handed} == {id(m) for m in linears}
    matmuls = [list(m.part_matmuls) for m in linears]
    platform.prepare_model(model)
    assert [list(m.part_matmuls) for m in linears] == matmuls
    references = [m for m in _load(FIXTURE).modules() if isinstance(m, QuantLinear)]
    torch.manual_seed(0)
    for linear, reference in zip(linears, references, strict=True):
        x = torch.randn(3, linear.in_features)
        torch.testing.assert_close(linear(x), reference(x), rtol=1e-4, atol=1e-4)


def test_an_open_gguf_file_keeps_no_vocabulary_arrays():
    """The gguf package parses every metadata array into one object per element (~150 MiB
    for a 49k vocabulary); the tokenizer reads them itself, so an open `GgufFile` keeps only
    a small part of what a bare reader holds."""
    import tracemalloc

    from gguf import GGUFReader

    source = FIXTURE.parent / "carpool-default-Q4_K_M.gguf"

    def held(open_file) -> int:
        gc.collect()
        tracemalloc.start()
        try:
            opened = open_file(source)
            gc.collect()
            size = tracemalloc.get_traced_memory()[0]
            del opened
            return size
        finally:
            tracemalloc.stop()

    bare, ours = held(GGUFReader), held(GgufFile)
    assert bare > 1_000_000 and ours < bare // 4, (bare, ours)
