"""The CPU platform's layer stack (`platform/cpu_layer_stack.py`,
`csrc/layers/layer_stack.cpp`): the steps it takes give the modules' hidden states to the
bit, on every architecture, in float32 and bfloat16, decode and mixed steps alike; it is
built only where the route says every layer is the kernels', and the steps it does not take
go through the modules."""

from __future__ import annotations

import random

import pytest
import torch
from runner_driver import Driver, DriverRequest

from carpool import kernels as cpu_kernels
from carpool.config import EngineConfig
from carpool.platform import cpu_linear, cpu_route
from carpool.platform.cpu_layer_stack import KernelLayerStack
from carpool.runner.model_runner import ModelRunner
from carpool.sampling_params import SamplingParams

needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C++ kernels here")


def make_runner(path, dtype: str, **kwargs) -> ModelRunner:
    settings = dict(max_model_len=256, max_num_batched_tokens=128, max_num_seqs=8,
                    num_kv_blocks=96, block_size=4, device="cpu", dtype=dtype)
    settings.update(kwargs)
    return ModelRunner(EngineConfig.from_args(str(path), **settings), path)


def compare_each_step(runner: ModelRunner, monkeypatch) -> list[bool]:
    """Make every step run the model twice, with the stack where it takes the step and with
    the modules alone, and assert the two hidden states are equal to the bit (the second
    run rewrites the same keys and values). Returns, per step, whether the stack took it."""
    model, taken = runner.model, []
    forward = model.forward

    def both(input_ids, positions, kv_caches, attention, meta, lora=None):
        stack = model.layer_stack
        taken.append(stack.takes(meta, lora))
        got = forward(input_ids, positions, kv_caches, attention, meta, lora)
        model.layer_stack = None
        try:
            expected = forward(input_ids, positions, kv_caches, attention, meta, lora)
        finally:
            model.layer_stack = stack
        assert got.dtype == expected.dtype and torch.equal(got, expected)
        return got

    monkeypatch.setattr(model, "forward", both)
    return taken


def requests(seed: int) -> list[DriverRequest]:
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    return [DriverRequest(f"r{i}", [rng.randrange(1, 500) for _ in range(n)], params,
                          arrival_step=arrival)
            for i, (n, arrival) in enumerate([(9, 0), (2, 0), (21, 3)])]


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}),
    ("qwen2", {}),  # q/k/v biases, tied embeddings
    ("qwen3", {}),  # q and k norms, head_dim 32
    ("mistral", {"sliding_window": 6}),  # one kv head, a window the prompts outgrow
])
def test_stack_steps_give_the_modules_hidden_states_bitwise(make_checkpoint, monkeypatch,
                                                             arch, overrides, dtype):
    runner = make_runner(make_checkpoint(arch, **overrides), dtype)
    assert isinstance(runner.model.layer_stack, KernelLayerStack)
    taken = compare_each_step(runner, monkeypatch)
    # Prompts in chunks of 4 beside the other requests' decodes, then decodes alone.
    Driver(runner, chunk=4).run(requests(seed=len(arch)))
    assert len(taken) > 8 and all(taken)


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch,overrides", [
    ("mixtral", {}),  # every layer sparse, top 2 of 8
    ("qwen3_moe", {}),  # a dense layer among sparse ones (layer 1), q and k norms
])
def test_sparse_layers_run_in_the_stack_as_the_modules_run_them(make_checkpoint, monkeypatch,
                                                                 arch, overrides, dtype):
    runner = make_runner(make_checkpoint(arch, **overrides), dtype)
    stack = runner.model.layer_stack
    assert isinstance(stack, KernelLayerStack) and stack._sparse
    taken = compare_each_step(runner, monkeypatch)
    Driver(runner, chunk=4).run(requests(seed=len(arch)))
    assert len(taken) > 8 and all(taken)


@needs_kernels
def test_counting_the_router_load_keeps_the_modules(make_checkpoint):
    runner = make_runner(make_checkpoint("mixtral"), "float32", moe_router_stats=True)
    assert isinstance(runner.model.layer_stack, KernelLayerStack)
    Driver(runner, chunk=4).run(requests(seed=3))
    # every routed row counted: the modules ran every step (the stack counts none)
    tokens = 9 + 2 + 21 + 3 * 5  # the prompts, then each request's 5 decodes after its first
    load = runner.router_load()
    assert load and all(sum(layer) == tokens * runner.model.config.moe.top_k for layer in load)


@needs_kernels
def test_a_shared_expert_keeps_the_modules(make_checkpoint):
    runner = make_runner(make_checkpoint("qwen2_moe"), "float32")
    assert runner.model.layer_stack is None


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stack_steps_with_lora_adapters_give_the_modules_hidden_states_bitwise(
        make_checkpoint, tmp_path, monkeypatch, dtype):
    from carpool.lora_request import LoRARequest
    from carpool.testing.peft_adapters import ALL_MODULES, build_adapter

    path = make_checkpoint("qwen3")
    loras = [LoRARequest(f"a{i}", i + 1, str(build_adapter(
        path, tmp_path / f"a{i}", seed=i, rank=4 * (i + 1), dtype=dtype,
        target_modules=ALL_MODULES if i else ("q_proj", "v_proj")))) for i in range(2)]
    runner = make_runner(path, dtype, enable_lora=True, max_loras=2)
    assert runner.platform.route.lora_steps == "in the C++ layer stack"
    taken = compare_each_step(runner, monkeypatch)
    reqs = requests(seed=9)
    for req, lora in zip(reqs, (loras[0], None, loras[1])):
        req.lora_request = lora
    Driver(runner, chunk=4).run(reqs)
    assert len(taken) > 8 and all(taken)


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_calls_beyond_the_small_gemm_run_the_linears_own_forward(make_checkpoint, monkeypatch,
                                                                 dtype):
    # Small GEMMs of 3 rows at most: the stack hands every larger call (prompt chunks, and
    # decodes beside them) back to PackedLinear.forward (oneDNN), under the GIL.
    monkeypatch.setattr(cpu_route, "SMALL_GEMM_AMX_TILE_MAX_ROWS", 3)
    for cpu_class in cpu_route.CpuClass:
        monkeypatch.setitem(cpu_route.SMALL_GEMM_MAX_ROWS, cpu_class,
                            {torch.bfloat16: 3, torch.float32: 3})
    runner = make_runner(make_checkpoint("qwen2"), dtype)
    linears = [m for m in runner.model.modules() if isinstance(m, cpu_linear.PackedLinear)]
    assert linears and all(lin.small.max_rows == 3 for lin in linears)
    calls = []
    for lin in linears:
        forward = lin.forward
        monkeypatch.setattr(lin, "forward", lambda x, f=forward: calls.append(x.shape[0]) or f(x))
    runner.model.layer_stack = KernelLayerStack.of(runner.model, cpu_kernels.load(),
                                                   runner.platform.route)
    taken = compare_each_step(runner, monkeypatch)
    Driver(runner, chunk=4).run(requests(seed=5))
    assert all(taken) and max(calls) > 3


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_invariant_mode_runs_on_the_stack_with_every_call_on_the_small_gemm(
        make_checkpoint, monkeypatch, dtype):
    """Invariance rides the fast path: the vector small GEMM takes calls of every size (its
    rows are independent), so the stack runs, its attention in the invariant order."""
    runner = make_runner(make_checkpoint("llama"), dtype, batch_invariant=True)
    route = runner.platform.route
    if route.linears.small_gemm is None:
        pytest.skip(f"no {dtype} small GEMM on this CPU: the linears take oneDNN tiles")
    assert route.linears.small_gemm.max_rows == cpu_route.ALL_ROWS
    assert route.attention.batch_invariant
    assert isinstance(runner.model.layer_stack, KernelLayerStack)
    linears = [m for m in runner.model.modules() if isinstance(m, cpu_linear.PackedLinear)]
    assert linears and all(m.small is not None and not m.small.amx for m in linears)
    taken = compare_each_step(runner, monkeypatch)
    Driver(runner, chunk=4).run(requests(seed=2))
    assert len(taken) > 8 and all(taken)


@needs_kernels
@pytest.mark.parametrize("setting", [dict(cpu_packed_linears=False),
                                     dict(cpu_kernels=False), dict(dtype="float16")])
def test_no_stack_where_a_layer_is_not_all_kernels(make_checkpoint, setting):
    settings = {"dtype": "bfloat16", **setting}
    assert make_runner(make_checkpoint("llama"), **settings).model.layer_stack is None


@needs_kernels
def test_other_attention_backends_keep_the_modules(make_checkpoint):
    runner = make_runner(make_checkpoint("llama"), "bfloat16", attention_backend="sdpa")
    route = runner.platform.route  # the layers are the kernels', attention not
    assert route.linears.small_gemm is not None and not route.layer_stack
    assert runner.model.layer_stack is None
    Driver(runner, chunk=4).run(requests(seed=1))


@needs_kernels
def test_the_stack_keeps_the_modules_for_a_backend_made_apart(make_checkpoint, monkeypatch):
    """A backend not made by the platform (here the PyTorch one) never hands the stack a
    step: its metadata is not the kernels backend's."""
    from carpool.attention import create_backend

    runner = make_runner(make_checkpoint("llama"), "bfloat16")
    assert runner.model.layer_stack is not None
    runner.attention = create_backend("cpu", runner.attention.shape, runner.device)
    taken = compare_each_step(runner, monkeypatch)
    Driver(runner, chunk=4).run(requests(seed=1))
    assert taken and not any(taken)


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("source", ["Q8_0", "Q5_0", "Q4_0", "llama.cpp Q4_K_M", "W8A8"])
def test_quantized_linears_run_inside_the_stack(make_checkpoint, monkeypatch, tmp_path, source,
                                                dtype):
    """A quantized model's linears multiply in the stack (quant_linear on each packed part,
    then the bias: qwen2's q/k/v biases; W8A8 per channel as w8a8_linear's int8 products),
    giving the modules' hidden states to the bit, and call their module back only
    above their cut."""
    from pathlib import Path

    from carpool.models.quant.linear import QuantLinear
    from carpool.testing.gguf_writer import write_gguf

    if source.startswith("llama.cpp"):
        path = Path(__file__).parents[1] / "fixtures" / "gguf" / "tiny-qwen2-Q4_K_M.gguf"
    elif source == "W8A8":  # compressed-tensors' own compressor writes it
        from tests.engine.test_hf_quant_equivalence import compress
        path = compress(make_checkpoint("qwen2"), tmp_path / "w8a8", "W8A8", "int-quantized",
                        torch.float32)
    else:
        path = write_gguf(make_checkpoint("qwen2"), tmp_path / f"qwen2-{source}.gguf", source)
    runner = make_runner(path, dtype)
    linears = [m for m in runner.model.modules() if isinstance(m, QuantLinear)]
    assert linears and all(lin.stack_parts is not None for lin in linears)
    # W8A8 per channel: int8 x int8 (pack_w8a8_weight), which rounds its input itself
    assert all(all(p.w8a8 for p in lin.stack_parts.packed) == (source == "W8A8")
               and not lin.stack_parts.int8_input for lin in linears)
    stack = Flagged(runner.model.layer_stack)
    callbacks = []
    for lin in linears:
        forward = lin.forward
        monkeypatch.setattr(lin, "forward", lambda x, f=forward: (
            callbacks.append(x.shape[0]) if stack.active else None) or f(x))
    stack.inner = KernelLayerStack.of(runner.model, cpu_kernels.load(), runner.platform.route)
    runner.model.layer_stack = stack
    taken = compare_each_step(runner, monkeypatch)
    Driver(runner, chunk=4).run(requests(seed=3))
    assert len(taken) > 8 and all(taken)
    assert callbacks == []  # every call of these steps is under the cut: none left the stack


class Flagged:
    """A layer stack that says whether a step is inside it."""

    def __init__(self, inner) -> None:
        self.inner, self.active = inner, False

    def takes(self, meta, lora=None) -> bool:
        return self.inner.takes(meta, lora)

    def __call__(self, *args, **kwargs):
        self.active = True
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.active = False
