"""Whether a request could ever run: its prompt plus its largest possible output in the pool.

One check, used where a request is refused before it is queued (the engine's
`validate_request`, with OpenAI's words for the front ends) and where it is
registered with a scheduler (a request that fails it would wait forever).
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for non-negative a and positive b (blocks for a tokens, etc.)."""
    return -(-a // b)


def check_fits_pool(num_prompt_tokens: int, max_output_tokens: int, block_size: int,
                    num_total_blocks: int) -> None:
    """ValueError, with the numbers, when prompt + max output needs more blocks than exist."""
    num_tokens = num_prompt_tokens + max_output_tokens
    num_blocks = cdiv(num_tokens, block_size)
    if num_blocks > num_total_blocks:
        raise ValueError(
            f"this request may need {num_tokens} tokens of KV cache ({num_prompt_tokens} prompt "
            f"+ {max_output_tokens} max output) = {num_blocks} blocks of {block_size} tokens, "
            f"but the whole cache has {num_total_blocks} blocks; lower max_tokens, shorten the "
            "prompt or give the KV cache more memory")
