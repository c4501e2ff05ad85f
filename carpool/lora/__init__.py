"""LoRA adapters over one base model: PEFT folders read and checked (`peft_adapter`), the
loaded ones kept least recently used first (`adapter_cache`), and one step's rows grouped by
adapter (`step_lora`), whose `add` the model's layers call after each base linear."""
