"""Tiny random Hugging Face checkpoints and an offline BPE tokenizer, for tests and benchmarks.

No model hub is reachable here, so tests make their own checkpoints with
`transformers` (fixed seed, `save_pretrained`) plus a byte-level BPE tokenizer
trained with `tokenizers` on Python's own standard-library sources, and load
them through the same code a user's real checkpoint goes through. transformers'
model code is used only to *write* the checkpoint (and, in tests, as the
reference); it is never in carpool's serving path.
"""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = [EOS_TOKEN, "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Shapes of the tiny test models, one per supported architecture. Small enough that
# Hugging Face's reference `generate` runs quickly on 2 CPU cores.
TINY_SHAPES: dict[str, dict] = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2),
    "mistral": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=1),  # MQA
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32),  # head_dim != 64/4
    # Mixtures of experts: layer 1 dense among sparse ones (mlp_only_layers), top 2 of 8.
    "qwen3_moe": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                      mlp_only_layers=[1], num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16),
    "mixtral": dict(hidden_size=64, intermediate_size=32, num_local_experts=8,
                    num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2),
    # A shared expert behind its gate; every second layer sparse (decoder_sparse_step 2).
    "qwen2_moe": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                      decoder_sparse_step=2, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2),
}


def random_prompt(rng, num_tokens: int, vocab_size: int = 512) -> list[int]:
    """`num_tokens` token ids drawn by `rng` (a random.Random) from a checkpoint's vocabulary."""
    return [rng.randrange(vocab_size) for _ in range(num_tokens)]


def stdlib_corpus_files(limit: int | None = None) -> list[Path]:
    """Python standard-library sources (PSF licence), sorted, present on every machine."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    return files[:limit] if limit else files


def train_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 512,
                    corpus_files: list[Path] | None = None):
    """Train a byte-level BPE tokenizer offline and save it as a HF tokenizer folder.

    Returns the `transformers.PreTrainedTokenizerFast` it saved.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = corpus_files or stdlib_corpus_files(limit=40)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(f) for f in files], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN,
        unk_token=None, pad_token=EOS_TOKEN)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def build_checkpoint(out_dir: str | os.PathLike, arch: str = "llama", *, seed: int = 0,
                     vocab_size: int = 512, dtype: str = "float32",
                     tokenizer_dir: str | os.PathLike | None = None,
                     max_position_embeddings: int = 2048, **config_overrides) -> Path:
    """Write a random `arch` checkpoint (config, safetensors, tokenizer, generation config).

    `arch` is one of TINY_SHAPES' keys; `config_overrides` replace or extend its shape
    (e.g. `rope_scaling`, `num_hidden_layers`). With `tokenizer_dir`, that tokenizer is
    copied instead of training a new one. Returns the folder.
    """
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is None:
        tokenizer = train_tokenizer(out, vocab_size=vocab_size)
    else:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
        tokenizer.save_pretrained(str(out))
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)

    config_cls, model_cls = _ARCHS[arch]
    shape = dict(TINY_SHAPES[arch])
    shape.update(config_overrides)
    config = getattr(transformers, config_cls)(
        vocab_size=vocab_size, max_position_embeddings=max_position_embeddings,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, **shape)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    _perturb_norms(model, seed)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(str(out), safe_serialization=True)
    gen = transformers.GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id,
                                        pad_token_id=eos_id)
    gen.save_pretrained(str(out))
    return out


_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
}


def _perturb_norms(model, seed: int) -> None:
    """Give norm weights and biases random values, so a loader that drops them is caught.

    Fresh HF models initialise RMSNorm weights to 1 and biases to 0; a loader that
    forgot them would still match. Random values make every tensor matter.
    """
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))


def read_config(path: str | os.PathLike) -> dict:
    with open(Path(path) / "config.json") as f:
        return json.load(f)


def truncated_checkpoint(source: str | os.PathLike, out_dir: str | os.PathLike,
                         num_layers: int) -> Path:
    """A copy of the checkpoint folder `source` keeping only its first `num_layers` decoder
    layers (same embeddings, final norm, head and tokenizer): a draft model that shares the
    target's vocabulary and agrees with it more than an unrelated model does."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    source, out = Path(source), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.is_file() and file.suffix != ".safetensors" and file.name != "config.json":
            shutil.copy(file, out / file.name)
    config = read_config(source)
    config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    layer = re.compile(r"\blayers\.(\d+)\.")
    weights = {}
    for file in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(str(file)).items():
            match = layer.search(name)
            if match is None or int(match.group(1)) < num_layers:
                weights[name] = tensor
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
