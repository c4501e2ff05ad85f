"""Prompt lookup: the longest suffix match (max down to min), its most recent earlier
occurrence, up to k tokens, a loop shorter than k continued; checked against a brute-force
scan over random token lists as they grow."""

from __future__ import annotations

import random

from carpool.core.ngram_proposer import NgramIndex
from carpool.core.request import Request


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if n > len(tokens):
            continue
        suffix = tokens[len(tokens) - n:]
        for end in range(len(tokens) - 1, n - 1, -1):  # most recent occurrence first
            if tokens[end - n:end] == suffix:
                draft = []
                for i in range(end, end + k):
                    draft.append(tokens[i] if i < len(tokens) else draft[i - len(tokens)])
                return draft
    return []


def test_examples():
    request = Request("r", [1, 2, 3, 4, 1, 2, 3, 4, 1, 2])
    index = NgramIndex(2, 5)
    assert index.propose(request, 4) == [3, 4, 1, 2]
    request.output_token_ids.extend([3, 9])  # "3 9" never occurred; "9" alone neither
    assert index.propose(request, 4) == []
    assert NgramIndex(1, 1).propose(Request("s", [5, 6, 7, 5]), 2) == [6, 7]
    # a loop of period 2 continues past the end
    assert NgramIndex(2, 3).propose(Request("t", [7, 8, 7, 8]), 5) == [7, 8, 7, 8, 7]
    # the longest match wins over a more recent shorter one
    assert NgramIndex(1, 3).propose(Request("u", [1, 2, 3, 50, 9, 3, 60, 1, 2, 3]), 1) == [50]
    assert NgramIndex(2, 2).propose(Request("v", [4]), 3) == []


def test_matches_brute_force_as_tokens_grow():
    rng = random.Random(0)
    for trial in range(40):
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        k = rng.randint(1, 6)
        vocab = rng.randint(2, 6)  # small vocabularies repeat often
        request = Request(f"r{trial}", [rng.randrange(vocab) for _ in range(rng.randint(1, 20))])
        index = NgramIndex(min_n, max_n)
        for _ in range(30):
            tokens = request.prompt_token_ids + request.output_token_ids
            assert index.propose(request, k) == brute_force(tokens, min_n, max_n, k), (
                tokens, min_n, max_n, k)
            request.output_token_ids.extend(rng.randrange(vocab)
                                            for _ in range(rng.randint(1, 3)))
