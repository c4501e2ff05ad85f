"""The server's grammar check: off the event loop, in a process of its own, with a time budget.

llguidance checks a grammar in Rust, for as long as it takes, and a grammar it cannot bound
overflows its stack (a SIGSEGV no handler catches). So the server measures the grammar
against its `GrammarLimits` first, then hands it to one reused checker process
(`check_worker`): a check that runs past `check_timeout` has the process killed, a crash
costs the process; either is a 400 for that request and the next check starts a new one.
Answers are cached by the grammar's content (good and bad alike), so a resent grammar costs
nothing. `check` blocks: the server calls it on `executor`, the checker's own thread, so
checks queue there and never hold the threads the rest of the server shares.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from carpool.sampling_params import GrammarLimits, StructuredOutputsParams
from carpool.structured.check_worker import HEADER, encode_request, frame
from carpool.structured.limits import NOUNS, check_limits

logger = logging.getLogger(__name__)

# Answers kept, by the grammar's digest: each a message of a few hundred bytes at most.
MAX_CACHED_ANSWERS = 4096
# The folder that holds the `carpool` package, where the checker process starts.
_PACKAGE_PARENT = Path(__file__).resolve().parents[2]


class GrammarChecker:
    def __init__(self, limits: GrammarLimits) -> None:
        self.limits = limits
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="carpool-grammar-check")
        self._lock = threading.Lock()  # one check at a time in the one process
        self._process: subprocess.Popen | None = None
        self._answers: OrderedDict[bytes, str | None] = OrderedDict()
        self.num_asked = 0  # grammars sent to the checker process (tests)
        self.num_restarts = 0  # processes that died or were killed (tests)

    def check(self, params: StructuredOutputsParams, field: str = "structured_outputs") -> None:
        """ValueError naming `field` when the grammar of `params` is over the limits, invalid,
        too slow to check or crashes the checker."""
        check_limits(params, self.limits, field)
        key = hashlib.sha256(encode_request(params, field, self.limits)).digest()
        with self._lock:
            if key in self._answers:
                self._answers.move_to_end(key)
                answer = self._answers[key]
            else:
                answer = self._ask(params, field)
                self._answers[key] = answer
                if len(self._answers) > MAX_CACHED_ANSWERS:
                    self._answers.popitem(last=False)
        if answer is not None:
            raise ValueError(answer)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            self._stop()

    def _ask(self, params: StructuredOutputsParams, field: str) -> str | None:
        request = frame(encode_request(params, field, self.limits))
        self.num_asked += 1
        process = self._running()
        try:
            process.stdin.write(request)
            process.stdin.flush()
            reply = self._read_reply(process, time.monotonic() + self.limits.check_timeout)
        except TimeoutError:
            self._stop()
            self.num_restarts += 1
            logger.warning("a request's %s took more than %g s to check; its checker "
                           "process was killed", field, self.limits.check_timeout)
            return (f"{field}: the {NOUNS[params.kind]} took more than "
                    f"{self.limits.check_timeout:g} s to check (--grammar-check-timeout); make "
                    "it smaller")
        except (OSError, EOFError):
            code = self._stop()
            self.num_restarts += 1
            logger.warning("the grammar checker process died (exit code %s) on a request's "
                           "%s; the next check starts a new one", code, field)
            return (f"{field}: the {NOUNS[params.kind]} crashed the grammar library (too many "
                    "rules or too deep a nesting for it); make it smaller")
        return json.loads(reply)

    def _running(self) -> subprocess.Popen:
        if self._process is None or self._process.poll() is not None:
            if self._process is not None:
                self._stop()
            self._process = subprocess.Popen(
                [sys.executable, "-m", "carpool.structured.check_worker"], cwd=_PACKAGE_PARENT,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        return self._process

    def _stop(self) -> int | None:
        process, self._process = self._process, None
        if process is None:
            return None
        process.kill()
        for pipe in (process.stdin, process.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        return process.wait()

    @staticmethod
    def _read_reply(process: subprocess.Popen, deadline: float) -> bytes:
        fd = process.stdout.fileno()
        data = b""
        size = None
        while size is None or len(data) < HEADER.size + size:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise EOFError
            data += chunk
            if size is None and len(data) >= HEADER.size:
                (size,) = HEADER.unpack(data[:HEADER.size])
        return data[HEADER.size:]

