"""The PyTorch reference of the compiled kernels: what each bound op computes, written for
reading, not speed. Each kernel test compares its op with the function of the same name here.
"""

from __future__ import annotations

import torch


def paged_attention_reference(out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor,
                              block_tables: torch.Tensor, query_starts: torch.Tensor,
                              query_lens: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                              sliding_window: int) -> None:
    """What the kernel computes, one request at a time: writes the covered rows of out.

    Request i's queries q[query_starts[i] : + query_lens[i]] sit at the last query_lens[i]
    of positions 0 .. seq_lens[i] - 1 and attend the keys at positions <= their own (and
    less than sliding_window behind, if it is > 0), in a float32 softmax of scale * q.k.
    """
    _, num_kv_heads, _, block_size, head_dim = kv_cache.shape
    group_size = q.shape[1] // num_kv_heads
    for i in range(block_tables.shape[0]):
        start, q_len, seq_len = int(query_starts[i]), int(query_lens[i]), int(seq_lens[i])
        if q_len == 0:
            continue
        blocks = block_tables[i, :-(-seq_len // block_size)].long()
        # (2, Hkv, num_blocks, block_size, D) -> (2, Hkv, seq_len, D)
        kv = kv_cache[:, :, blocks].flatten(2, 3)[:, :, :seq_len].float()
        keys = kv[0].repeat_interleave(group_size, dim=0)  # (H, seq_len, D)
        values = kv[1].repeat_interleave(group_size, dim=0)
        queries = q[start:start + q_len].float().transpose(0, 1)  # (H, q_len, D)
        scores = scale * (queries @ keys.transpose(1, 2))  # (H, q_len, seq_len)
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window > 0:
            allowed &= q_pos - k_pos < sliding_window
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        out[start:start + q_len] = (probs @ values).transpose(0, 1).to(out.dtype)
