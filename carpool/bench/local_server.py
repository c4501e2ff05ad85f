"""Start a real `carpool serve` on a free loopback port, for serving benchmarks and their tests.

The server runs as its own process (as a user would run it), so the load
generator measures the whole HTTP path. `LocalServer` waits for /health to
answer 200 and stops the process on exit; if the server dies first its log is
in the error.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """`with LocalServer(model, flags, log_path) as base_url: ...`"""

    def __init__(self, model: str | os.PathLike, flags: list[str], log_path: str | os.PathLike,
                 startup_timeout_s: float = 180.0, *,
                 launcher: Sequence[str] = (sys.executable, "-m", "carpool.cli"),
                 env: Mapping[str, str] | None = None) -> None:
        """`launcher` is what runs `serve ...` (a test may start a script of its own);
        `env` adds variables to the server's environment."""
        self.model, self.flags = str(model), list(flags)
        self.launcher, self.env = list(launcher), dict(env or {})
        self.log_path = Path(log_path)
        self.startup_timeout_s = startup_timeout_s
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> str:
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [*self.launcher, "serve", self.model, "--port", str(self.port), *self.flags],
                stdout=log, stderr=subprocess.STDOUT,
                env=dict(os.environ, PYTHONUNBUFFERED="1", **self.env))
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self.base_url

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError("carpool serve exited with "
                                   f"{self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("carpool serve not healthy after "
                           f"{self.startup_timeout_s}s:\n{self.log()}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
