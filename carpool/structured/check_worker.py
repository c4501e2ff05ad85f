"""The grammar checker's own process (`checker.GrammarChecker` starts and feeds it).

A grammar the library cannot bound can overflow its stack, which no Python code catches:
here that costs this process and the one request, never the server. Each frame on stdin is
(params, field, limits) from the server as JSON (`encode_request`); each reply on stdout is
the JSON error message, or null when the grammar is good (plain data both ways: nothing here
unpickles). Runs on its main thread's default stack,
smaller than the engine's compile thread's, so a grammar that passes here compiles there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import sys

from carpool.sampling_params import GrammarLimits, StructuredOutputsParams
from carpool.structured.grammar import check

HEADER = struct.Struct("<Q")  # each frame's length in bytes


def read_frame(stream) -> bytes | None:
    """One frame's bytes, None at the end of the stream."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (size,) = HEADER.unpack(header)
    data = stream.read(size)
    return data if len(data) == size else None


def frame(data: bytes) -> bytes:
    return HEADER.pack(len(data)) + data


def encode_request(params: StructuredOutputsParams, field: str, limits: GrammarLimits) -> bytes:
    """One check's arguments as JSON bytes (also the cache key of its answer)."""
    return json.dumps([dataclasses.asdict(params), field, dataclasses.asdict(limits)],
                      sort_keys=True).encode()


def decode_request(data: bytes) -> tuple[StructuredOutputsParams, str, GrammarLimits]:
    params, field, limits = json.loads(data)
    return StructuredOutputsParams(**params), field, GrammarLimits(**limits)


def main() -> None:
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever the library prints goes to stderr, not into the replies
    while (data := read_frame(sys.stdin.buffer)) is not None:
        params, field, limits = decode_request(data)  # from the server that started us
        try:
            check(params, field, limits)
            reply = None
        except ValueError as exc:
            reply = str(exc)
        except Exception as exc:  # noqa: BLE001 - any failure is this grammar's, not ours
            reply = f"{field}: the grammar library failed on it ({type(exc).__name__})"
        replies.write(frame(json.dumps(reply).encode()))
        replies.flush()


if __name__ == "__main__":
    main()
