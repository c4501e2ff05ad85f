"""Fed docs/lab/35-the-first-run-on-a-gpu-h200.md.

What SDPA costs at a shape it has not seen, by backend: the `sdpa` attention backend's
two call shapes, each at many distinct lengths, first call against later calls.

Why: on the H200 (BENCHMARKS.md §35) carpool's CUDA path took 5.4 s to the median first
token on 200 prompts of distinct lengths, and torch ran its masked SDPA calls on cuDNN,
which builds an execution plan per new shape (others measured 0.26–0.4 s per build). The
sdpa backend meets a new shape with every fresh prompt length and, in decode groups, with
every 16 tokens of context. This times, per backend that can run the shape, the first call
at each new length and the mean of the next calls, on fresh shapes only.

    python3 -m benchmarks.archive.sdpa_new_shapes --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--lengths", type=int, default=12, help="distinct lengths per case")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--decodes", type=int, default=256, help="rows of a decode group")
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    if device.type != "cuda":
        backends = {"math": SDPBackend.MATH}
    h, hkv, d = args.heads, args.kv_heads, args.head_dim

    def fresh_prompt(length: int):
        """A fresh prompt: causal, no mask, batch of one (attend_fresh_sdpa)."""
        q = torch.randn(1, h, length, d, device=device, dtype=dtype)
        k = torch.randn(1, hkv, length, d, device=device, dtype=dtype)
        return lambda: F.scaled_dot_product_attention(q, k, k, is_causal=True,
                                                      enable_gqa=True)

    def decode_group(context: int):
        """A decode group: one query per row, a boolean mask over padded keys."""
        s = args.decodes
        q = torch.randn(s, h, 1, d, device=device, dtype=dtype)
        k = torch.randn(s, hkv, context, d, device=device, dtype=dtype)
        mask = torch.arange(context, device=device)[None, None, None, :] < context - 1  # a pad
        return lambda: F.scaled_dot_product_attention(q, k, k, attn_mask=mask,
                                                      enable_gqa=True)

    # Each (case, backend) is offset by its own salt: lengths no earlier one ran, so every
    # backend starts cold at each (cuDNN's plans are cached per shape, process-wide).
    cases = {"fresh prompt (causal)": (fresh_prompt, [97 + 31 * i for i in range(args.lengths)]),
             "decode group (masked)": (decode_group, [160 + 16 * i for i in range(args.lengths)])}
    salt = 0
    for case, (make, lengths) in cases.items():
        for name, backend in backends.items():
            salt += 1
            firsts, laters = [], []
            try:
                for length in lengths:
                    call = make(length + salt)
                    with sdpa_kernel([backend]):
                        sync()
                        start = time.perf_counter()
                        call()
                        sync()
                        firsts.append(time.perf_counter() - start)
                        start = time.perf_counter()
                        for _ in range(5):
                            call()
                        sync()
                        laters.append((time.perf_counter() - start) / 5)
            except RuntimeError as exc:
                print(f"{case:24} {name:9}: cannot run ({str(exc).splitlines()[0][:60]})")
                continue
            print(f"{case:24} {name:9}: first call at a new length "
                  f"{1000 * statistics.median(firsts):8.2f} ms median "
                  f"({1000 * max(firsts):.2f} max), later calls "
                  f"{1000 * statistics.median(laters):.3f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
