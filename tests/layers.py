"""Which part of carpool may import which: the table docs/ARCHITECTURE.md describes."""

from __future__ import annotations

# part -> the parts it may import (a part is a subpackage or a top-level module).
ALLOWED = {
    "core": {"sampling_params"},
    # the backend arrives as a forward argument; the built-in model's name resolves in paths
    "models": {"attention", "default_model_path", "distributed"},
    "attention": set(),
    "distributed": set(),
    "kernels": {"attention", "models"},  # reference.py computes with the modules' own code
    "platform": {"attention", "cpu_options", "kernels", "models", "utils"},
    "runner": {"attention", "config", "core", "distributed", "models", "outputs", "platform",
               "sampling_params", "structured", "utils"},
    "structured": {"sampling_params"},
    "utils": set(),
    "outputs": set(),
    "sampling_params": set(),
    "default_model_path": set(),
    "config": {"core", "cpu_options", "models", "default_model_path", "sampling_params", "utils"},
    "cpu_options": {"utils"},
    "engine": {"config", "core", "default_model_path", "models", "runner", "outputs",
               "sampling_params", "structured", "utils"},
    "llm": {"config", "engine", "outputs", "sampling_params"},
    "metrics": {"outputs"},
    "arg_utils": {"config", "core", "cpu_options"},
    "tp_worker_cli": {"arg_utils", "config", "engine"},
    "generate_cli": {"arg_utils", "config", "llm", "sampling_params"},
    "server": {"arg_utils", "config", "engine", "metrics", "outputs", "sampling_params",
               "structured", "utils"},
    "bench": {"config", "default_model_path", "engine", "llm", "sampling_params"},
    "sim": {"core", "sampling_params"},
    "testing": {"models", "default_model_path"},
    "cli": set(),  # imports sub-commands by name, lazily
    "__init__": {"llm", "sampling_params"},
}
