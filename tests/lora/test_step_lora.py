"""A step's `lora_add_` arguments (`StepLora.stack_terms`) with the runner's `KernelTerms`
shared over steps equal those built for the step alone, whatever set of adapters each step
runs; an unloaded adapter's tensors are not held after `clear`."""

from __future__ import annotations

import gc
import weakref

import torch

from carpool.lora.peft_adapter import LoraWeights, ModuleLora
from carpool.lora.step_lora import MODULES, KernelTerms, StepLora

LAYERS = 2


def adapter(name: str, seed: int, modules=MODULES) -> LoraWeights:
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(LAYERS):
        layer = {}
        for module in modules:
            a = torch.randn(8, 4, generator=gen)
            layer[module] = ModuleLora(a, ((0, 6, 0, 2, torch.randn(2, 6, generator=gen)),
                                           (6, 8, 2, 4, torch.randn(2, 2, generator=gen))))
        layers.append(layer)
    return LoraWeights(name, tuple(layers), 0)


def same_args(got: list[tuple], expected: list[tuple]) -> bool:
    return len(got) == len(expected) and all(
        g[0] == e[0] and g[1] == e[1] and g[4] == e[4]
        and len(g[2]) == len(e[2]) and all(x is y for x, y in zip(g[2], e[2]))
        and len(g[3]) == len(e[3]) and all(x is y for x, y in zip(g[3], e[3]))
        for g, e in zip(got, expected))


def test_shared_terms_equal_a_steps_own_over_changing_sets():
    x, y, z = adapter("x", 1), adapter("y", 2), adapter("z", 3, modules=("qkv", "down"))
    shared = KernelTerms()
    steps = [((0, 3, x), (3, 4, y)), ((0, 2, x), (2, 9, y)),  # same set, other rows
             ((0, 1, y), (1, 5, x)),  # other order
             ((2, 3, x), (3, 6, z)),  # z changes only qkv and down
             ((0, 3, x), (3, 4, y))]
    for groups in steps:
        alone = StepLora(groups, kernel=print).stack_terms(LAYERS)
        got = StepLora(groups, kernel=print, terms=shared).stack_terms(LAYERS)
        assert same_args(got, alone)
    o_term = got[1]  # layer 0's o: x and y both change it
    assert o_term[0] == [0, 3] and o_term[1] == [3, 4] and o_term[4][::4] == [0, 0, 1, 1]
    last = StepLora(((2, 3, x), (3, 6, z)), kernel=print, terms=shared).stack_terms(LAYERS)
    assert last[1][0] == [2] and last[0][0] == [2, 3]  # z has no o, has qkv


def test_clear_lets_an_unloaded_adapters_tensors_go():
    shared = KernelTerms()
    gone = adapter("gone", 4)
    StepLora(((0, 1, gone),), kernel=print, terms=shared).stack_terms(LAYERS)
    watch = weakref.ref(gone.layers[0]["qkv"].a)
    del gone
    gc.collect()
    assert watch() is not None  # held for the next step of the same set
    shared.clear()
    gc.collect()
    assert watch() is None
