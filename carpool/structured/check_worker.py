"""The grammar checker's own process (`checker.GrammarChecker` starts and feeds it).

A grammar the library cannot bound can overflow its stack, which no Python code catches:
here that costs this process and the one request, never the server. Each frame on stdin is
a pickled (params, field, limits) from the server; each reply on stdout is the pickled
error message, or None when the grammar is good. Runs on its main thread's default stack,
smaller than the engine's compile thread's, so a grammar that passes here compiles there.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys

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


def main() -> None:
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever the library prints goes to stderr, not into the replies
    while (data := read_frame(sys.stdin.buffer)) is not None:
        params, field, limits = pickle.loads(data)  # from the server that started us
        try:
            check(params, field, limits)
            reply = None
        except ValueError as exc:
            reply = str(exc)
        except Exception as exc:  # noqa: BLE001 - any failure is this grammar's, not ours
            reply = f"{field}: the grammar library failed on it ({type(exc).__name__})"
        replies.write(frame(pickle.dumps(reply)))
        replies.flush()


if __name__ == "__main__":
    main()
