"""Fed docs/lab/12-chat-streams.md.

Issue 20, item 2, measured directly: in a chat stream, the seconds between the role chunk
and the first content chunk, next to the time to each, for a few requests to a running server.
Before the fix the role chunk left before the prefill (gap = the prefill); after it, the two
leave together (gap ~ 0).

    python3 -m benchmarks.archive.role_chunk_gap --base-url http://127.0.0.1:8000 --model NAME \
        --tokenizer FOLDER --input-len 700 --num-requests 3
"""

from __future__ import annotations

import argparse
import json
import random
import time

import httpx
from transformers import AutoTokenizer


def one(client: httpx.Client, url: str, model: str, prompt: str) -> tuple[float, float]:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 4, "temperature": 0, "stream": True, "ignore_eos": True}
    start = time.perf_counter()
    role = content = None
    with client.stream("POST", url, json=body) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter() - start
            delta = (json.loads(line[6:]).get("choices") or [{}])[0].get("delta") or {}
            if role is None and "role" in delta:
                role = now
            if content is None and delta.get("content"):
                content = now
    return role, content


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--input-len", type=int, default=700)
    parser.add_argument("--num-requests", type=int, default=3)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    rng = random.Random(0)
    with httpx.Client(timeout=600) as client:
        for i in range(args.num_requests):
            ids = [rng.randrange(100, tokenizer.vocab_size - 100) for _ in range(args.input_len)]
            role, content = one(client, f"{args.base_url}/v1/chat/completions", args.model,
                                tokenizer.decode(ids))
            print(f"request {i}: role chunk at {role:.3f} s, first content at {content:.3f} s, "
                  f"gap {content - role:.3f} s")


if __name__ == "__main__":
    main()
