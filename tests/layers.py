"""Which part of carpool may import which: the table docs/ARCHITECTURE.md describes."""

from __future__ import annotations

# part -> the parts it may import (a part is a subpackage or a top-level module).
ALLOWED = {
    "core": {"lora_request", "sampling_params"},
    # the backend arrives as a forward argument; the built-in model's name resolves in paths
    "models": {"attention", "default_model_path", "distributed"},
    "attention": set(),
    "distributed": set(),
    "kernels": {"attention", "models"},  # reference.py computes with the modules' own code
    "platform": {"attention", "cpu_options", "kernels", "models", "utils"},
    "runner": {"attention", "config", "core", "distributed", "lora", "lora_request", "models",
               "outputs", "platform", "sampling_params", "structured", "utils"},
    "structured": {"sampling_params"},
    "utils": set(),
    "outputs": set(),
    "sampling_params": set(),
    "lora_request": set(),
    # PEFT adapters read against the base model's config; the step's rows by adapter
    "lora": {"core", "lora_request", "models"},
    "default_model_path": set(),
    "config": {"core", "cpu_options", "lora_request", "models", "default_model_path",
               "sampling_params", "utils"},
    "cpu_options": {"utils"},
    "engine": {"config", "core", "default_model_path", "lora", "lora_request", "models",
               "runner", "outputs", "sampling_params", "structured", "utils"},
    "llm": {"config", "engine", "lora_request", "outputs", "sampling_params"},
    "metrics": {"outputs"},
    "arg_utils": {"config", "core", "cpu_options", "lora_request"},
    "tp_worker_cli": {"arg_utils", "config", "engine"},
    "generate_cli": {"arg_utils", "config", "llm", "sampling_params"},
    "server": {"arg_utils", "config", "engine", "lora", "lora_request", "metrics", "outputs",
               "sampling_params", "structured", "utils"},
    "bench": {"config", "default_model_path", "engine", "llm", "sampling_params"},
    "sim": {"core", "sampling_params"},
    "testing": {"models", "default_model_path"},
    "cli": set(),  # imports sub-commands by name, lazily
    "__init__": {"llm", "lora_request", "sampling_params"},
}
