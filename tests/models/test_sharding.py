"""Each tensor-parallel rank builds and loads exactly its shard of the checkpoint.

The shards are compared with slices of the checkpoint's own tensors (read with
safetensors); the group here only names the rank (loading runs no collective), so
both ranks of a two-rank layout are checked in this one process.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from carpool.distributed import TensorParallelGroup
from carpool.models.config import load_model_config
from carpool.models.loader import load_model
from carpool.models.sharding import ShardLayout, check_divisible


def load_rank(path, rank: int, world_size: int):
    config = load_model_config(path)
    return load_model(path, config, torch.float32, torch.device("cpu"),
                      TensorParallelGroup(rank, world_size))


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_holds_its_slices_and_mqa_replicates_the_kv_head(make_checkpoint, rank):
    path = make_checkpoint("mistral")  # 4 query heads of 16, one KV head, MLP 128, vocab 512
    hf = load_file(str(path / "model.safetensors"))
    model = load_rank(path, rank, 2)
    attn = model.model.layers[0].self_attn
    qkv = attn.qkv_proj.weight
    prefix = "model.layers.0."
    assert torch.equal(qkv[:32], hf[prefix + "self_attn.q_proj.weight"][32 * rank:32 * rank + 32])
    assert torch.equal(qkv[32:48], hf[prefix + "self_attn.k_proj.weight"])  # replicated
    assert torch.equal(qkv[48:], hf[prefix + "self_attn.v_proj.weight"])
    assert torch.equal(attn.o_proj.weight,
                       hf[prefix + "self_attn.o_proj.weight"][:, 32 * rank:32 * rank + 32])
    gate_up = model.model.layers[0].mlp.gate_up_proj.weight
    assert torch.equal(gate_up[:64], hf[prefix + "mlp.gate_proj.weight"][64 * rank:64 * rank + 64])
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight,
                       hf[prefix + "mlp.down_proj.weight"][:, 64 * rank:64 * rank + 64])
    assert torch.equal(model.model.embed_tokens.weight,
                       hf["model.embed_tokens.weight"][256 * rank:256 * rank + 256])
    assert torch.equal(model.lm_head.weight, hf["lm_head.weight"][256 * rank:256 * rank + 256])


def test_odd_vocab_is_padded_with_zero_rows_and_row_parallel_bias_lives_on_rank_0(
        make_checkpoint):
    path = make_checkpoint("qwen2", vocab_size=515)  # tied embeddings, q/k/v biases
    hf = load_file(str(path / "model.safetensors"))
    rank0, rank1 = load_rank(path, 0, 2), load_rank(path, 1, 2)
    assert rank1.model.embed_tokens.weight.shape[0] == 258
    assert torch.equal(rank1.model.embed_tokens.weight[:257], hf["model.embed_tokens.weight"][258:])
    assert not rank1.model.embed_tokens.weight[257].any()
    assert rank1.lm_head.weight is rank1.model.embed_tokens.weight
    qkv_bias = rank1.model.layers[1].self_attn.qkv_proj.bias
    assert torch.equal(qkv_bias[:32], hf["model.layers.1.self_attn.q_proj.bias"][32:])
    # Qwen2's o_proj has no bias; a Llama with attention_bias has one, on rank 0 only.
    llama = make_checkpoint("llama", attention_bias=True)
    with_bias = [load_rank(llama, r, 2).model.layers[0].self_attn.o_proj for r in (0, 1)]
    assert with_bias[0].bias is not None and with_bias[1].bias is None
    assert torch.equal(with_bias[0].bias, load_file(str(llama / "model.safetensors"))[
        "model.layers.0.self_attn.o_proj.bias"])
    assert rank0.model.layers[0].self_attn.num_heads == 2


def test_layouts_split_or_replicate_kv_heads(make_checkpoint):
    gqa = load_model_config(make_checkpoint("llama"))  # 4 heads, 2 KV heads
    assert [(lay.num_heads, lay.num_kv_heads, lay.kv_head_start)
            for lay in (ShardLayout.of(gqa, r, 4) for r in range(4))] == [
        (1, 1, 0), (1, 1, 0), (1, 1, 1), (1, 1, 1)]
    assert ShardLayout.of(gqa, 1, 2).kv_head_start == 1
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(8\) must divide the model's "
                                         r"num_attention_heads \(4\)"):
        check_divisible(gqa, 8)
