"""How much one hostile client slows everyone else (issue 21): a victim's stream under attack.

Starts `carpool serve` (the built-in model unless --model) on loopback, then for
each attack runs it from background threads while a victim streams one greedy
300-token completion, and prints the victim's total time, its largest gap
between events and the slowest /health answer seen meanwhile. Every attack is
bounded: it stops when the victim is done. A server that dies under an attack (the
`grammar-chain` one killed it before issue 64) ends the run, printing its exit code.

    python3 -m benchmarks.features.hostile_clients [--attacks half-open,big-prompt,...]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from carpool.bench.local_server import LocalServer

VICTIM = {"prompt": "def f(x):", "max_tokens": 300, "temperature": 0, "ignore_eos": True,
          "stream": True}


def victim(base_url: str, model: str) -> tuple[float, float]:
    start = last = time.monotonic()
    largest = 0.0
    with httpx.Client(base_url=base_url, timeout=300) as http, http.stream(
            "POST", "/v1/completions", json={"model": model, **VICTIM}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line:
                now = time.monotonic()
                largest, last = max(largest, now - last), now
    return last - start, largest


def health_prober(base_url: str, stop: threading.Event, worst: list[float]) -> None:
    with httpx.Client(base_url=base_url, timeout=30) as http:
        while not stop.is_set():
            start = time.monotonic()
            try:
                http.get("/health")
            except httpx.HTTPError:
                pass
            worst[0] = max(worst[0], time.monotonic() - start)
            stop.wait(0.1)


def half_open(base_url: str, model: str, stop: threading.Event) -> None:
    """2,000 connections that never finish a request: partial headers, partial body, nothing."""
    url = urlsplit(base_url)
    payloads = [b"GET /v1/models HTTP/1.1\r\nHost: x\r\n",
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4000000\r\n\r\n"
                + b"x" * 20, b""]
    socks = []
    try:
        for i in range(2000):
            if stop.is_set():
                break
            try:
                s = socket.create_connection((url.hostname, url.port), timeout=2)
                s.sendall(payloads[i % 3])
                socks.append(s)
            except OSError:
                pass
        stop.wait()
    finally:
        for s in socks:
            s.close()


def non_readers(base_url: str, model: str, stop: threading.Event) -> None:
    """4 connections that each ask for 64 streamed choices of 500 tokens and never read."""
    import json
    url = urlsplit(base_url)
    body = json.dumps({"model": model, "prompt": "x", "n": 64, "max_tokens": 500,
                       "ignore_eos": True, "stream": True}).encode()
    socks = []
    try:
        for _ in range(4):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect((url.hostname, url.port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: " + str(len(body)).encode()
                      + b"\r\n\r\n" + body)
            socks.append(s)
        stop.wait()
    finally:
        for s in socks:
            s.close()


def _poster(path: str, body: Callable[[str], dict]) -> Callable:
    def attack(base_url: str, model: str, stop: threading.Event) -> None:
        with httpx.Client(base_url=base_url, timeout=60) as http:
            while not stop.is_set():
                try:
                    http.post(path, json=body(model))
                except httpx.HTTPError:
                    pass
    return attack


def _getter(path: str) -> Callable:
    def attack(base_url: str, model: str, stop: threading.Event) -> None:
        with httpx.Client(base_url=base_url, timeout=60) as http:
            while not stop.is_set():
                try:
                    http.get(path)
                except httpx.HTTPError:
                    pass
    return attack


_SALT = itertools.count()  # makes each grammar-allowed grammar new
def slow_reader(base_url: str, model: str, stop: threading.Event) -> None:
    """Issue 64 item 6: asks for a ~0.5 MB reply (8 choices x 100 tokens x 20 logprobs) and
    reads it at ~20 KB/s through a small receive buffer, again and again."""
    url = urlsplit(base_url)
    body = json.dumps({"model": model, "prompt": "def f(x):", "n": 8, "max_tokens": 100,
                       "logprobs": 20, "ignore_eos": True}).encode()
    while not stop.is_set():
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
            s.connect((url.hostname, url.port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: " + str(len(body)).encode()
                      + b"\r\n\r\n" + body)
            s.settimeout(60)
            while not stop.is_set() and s.recv(4096):
                stop.wait(0.2)


def engine_stop(base_url: str, model: str, stop: threading.Event) -> None:
    """Issue 64 item 8: the engine process stopped (SIGSTOP) for 2 s, once. The victim waits
    out the stop by design; /health says 503 once --engine-stall-timeout has passed."""
    pid = _server_pid(base_url)
    engines = _children(pid) if pid is not None else []
    for engine in engines:
        os.kill(engine, signal.SIGSTOP)
    try:
        stop.wait(2.0)
    finally:
        for engine in engines:
            os.kill(engine, signal.SIGCONT)


def fd_flood(base_url: str, model: str, stop: threading.Event) -> None:
    """Issue 64 item 9: 4,600 connections held open, more than a server under
    `ulimit -n 4096` has descriptors (`--server-nofile 4096` starts it under that limit)."""
    url = urlsplit(base_url)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY
                                                    else 65536, hard))
    socks = []
    try:
        for _ in range(4600):
            if stop.is_set():
                break
            try:
                s = socket.socket()
            except OSError:
                break  # this process's own descriptors ran out
            s.setblocking(False)
            try:
                s.connect((url.hostname, url.port))
            except BlockingIOError:
                pass
            except OSError:
                s.close()
                continue
            socks.append(s)
        stop.wait()
    finally:
        for s in socks:
            s.close()


# The server's pid per base URL, for the attacks that signal its engine (set by main).
_SERVER_PIDS: dict[str, int] = {}


def _server_pid(base_url: str) -> int | None:
    return _SERVER_PIDS.get(base_url)


def _logprob_reply(num_prompts: int) -> Callable[[str], dict]:
    """Issue 64 item 5: num_prompts prompts of 480 tokens with echo, logprobs 20 and
    prompt_logprobs 20 (10,101 logprob entries each: 12 are under the default
    --max-logprob-work, 64 and 256 over it)."""
    prompts = [[100 + (i + j) % 200 for j in range(480)] for i in range(num_prompts)]
    return lambda m: {"model": m, "prompt": prompts, "max_tokens": 1, "echo": True,
                      "logprobs": 20, "prompt_logprobs": 20}


BIG = "a " * 1_900_000  # ~3.8 MB, under the default 4 MiB body limit
ATTACKS: dict[str, tuple[int, Callable]] = {
    "half-open": (1, half_open),
    "non-readers": (1, non_readers),
    "big-prompt": (1, _poster("/v1/completions",
                              lambda m: {"model": m, "prompt": BIG, "max_tokens": 1})),
    "big-chat": (1, _poster("/v1/chat/completions", lambda m: {
        "model": m, "messages": [{"role": "user", "content": BIG}], "max_tokens": 1})),
    "metrics-pollers": (4, _getter("/metrics")),
    "many-stops": (1, _poster("/v1/completions", lambda m: {
        "model": m, "prompt": "x", "max_tokens": 16, "stop": [f"s{i}" for i in range(100_000)]})),
    # Issue 64's grammars: a rule chain that overflows llguidance's stack, a 640 KB GBNF
    # alternation and 100,000 choices (seconds of its Rust work each, unbounded).
    "grammar-chain": (1, _poster("/v1/completions", lambda m: {
        "model": m, "prompt": "x", "max_tokens": 4, "structured_outputs": {"grammar": "\n".join(
            ["start: r0", *(f'r{i}: r{i + 1} "x"' for i in range(3000)), 'r3000: "y"'])}})),
    "grammar-gbnf": (1, _poster("/v1/completions", lambda m: {
        "model": m, "prompt": "x", "max_tokens": 4,
        "guided_grammar": "root ::= " + " | ".join(f'"w{i}"' for i in range(59_000))})),
    "grammar-choices": (1, _poster("/v1/completions", lambda m: {
        "model": m, "prompt": "x", "max_tokens": 4,
        "guided_choice": [f"choice number {i} of many" for i in range(100_000)]})),
    # Big but within the default limits (1,900 alternatives, 54 KB), a new one each time:
    # no cache helps, every one is checked and then compiled by the engine.
    "grammar-allowed": (1, _poster("/v1/completions", lambda m: {
        "model": m, "prompt": "x", "max_tokens": 4, "guided_grammar": "root ::= " + " | ".join(
            f'"{next(_SALT)} word {i} of a long list"' if i == 0 else
            f'"word {i} of a long list"' for i in range(1_900))})),
    # issue 64
    "tokenize-flood": (8, _poster("/tokenize", lambda m: {"model": m, "prompt": BIG})),
    "logprob-reply-12": (1, _poster("/v1/completions", _logprob_reply(12))),
    "logprob-reply-64": (1, _poster("/v1/completions", _logprob_reply(64))),
    "logprob-reply-256": (1, _poster("/v1/completions", _logprob_reply(256))),
    "slow-readers": (4, slow_reader),
    "engine-stop": (1, engine_stop),
    "fd-flood": (1, fd_flood),
}


def rss_mib(pids: list[int]) -> float:
    """Resident memory of these processes together, in MiB."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as status:
                total += next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))
        except (OSError, StopIteration):
            pass
    return total / 1024


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            direct = [int(c) for c in f.read().split()]
    except OSError:
        return []
    return direct + [g for c in direct for g in _children(c)]


def rss_sampler(groups: list[list[int]], stop: threading.Event, peaks: list[float]) -> None:
    while not stop.is_set():
        for i, pids in enumerate(groups):
            peaks[i] = max(peaks[i], rss_mib(pids))
        stop.wait(0.1)


def run_attack(base_url: str, model: str, name: str | None,
               server_pid: int) -> tuple[float, float, float, list[float]]:
    """The victim's total time and largest gap, the slowest /health, and how much the
    resident memory of the front end and of the engine process(es) grew at its peak, MiB."""
    stop = threading.Event()
    worst_health = [0.0]
    groups = [[server_pid], _children(server_pid)]
    base = [rss_mib(pids) for pids in groups]
    peaks = list(base)
    threads = [threading.Thread(target=health_prober, args=(base_url, stop, worst_health)),
               threading.Thread(target=rss_sampler, args=(groups, stop, peaks))]
    if name is not None:
        count, attack = ATTACKS[name]
        threads += [threading.Thread(target=attack, args=(base_url, model, stop))
                    for _ in range(count)]
    for t in threads:
        t.start()
    time.sleep(1.0 if name else 0.0)  # let the attack get going
    try:
        total, gap = victim(base_url, model)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    return total, gap, worst_health[0], [p - b for p, b in zip(peaks, base)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the built-in model)")
    parser.add_argument("--attacks", default=",".join(ATTACKS))
    parser.add_argument("--flags", default="", help="extra `carpool serve` flags")
    parser.add_argument("--server-nofile", type=int, default=None,
                        help="start the server under this open-files limit (prlimit), as "
                             "`ulimit -n` would (the fd-flood attack)")
    args = parser.parse_args()
    from carpool.default_model_path import default_model_path
    model_path = args.model or str(default_model_path())
    log = Path(tempfile.mkdtemp()) / "server.log"
    launcher = [sys.executable, "-m", "carpool.cli"]
    if args.server_nofile is not None:
        launcher = ["prlimit", f"--nofile={args.server_nofile}:{args.server_nofile}", *launcher]
    server = LocalServer(model_path, ["--served-model-name", "m", *args.flags.split()], log,
                         launcher=launcher)
    with server as base_url:
        _SERVER_PIDS[base_url] = server.process.pid
        victim(base_url, "m")  # warm-up
        print("| attack | victim total s | largest gap s | slowest /health s "
              "| front-end RSS growth MiB | engine RSS growth MiB |")
        print("| --- | --- | --- | --- | --- | --- |")
        for name in [None, *args.attacks.split(",")]:
            try:
                total, gap, health, rss = run_attack(base_url, "m", name, server.process.pid)
            except httpx.HTTPError:
                if server.process.poll() is None:
                    raise
                print(f"| {name} | the server died: exit code {server.process.returncode} |")
                return
            print(f"| {name or 'none'} | {total:.2f} | {gap:.2f} | {health:.2f} | {rss[0]:.0f} "
                  f"| {rss[1]:.0f} |", flush=True)
            time.sleep(2.0)
        print(f"server log: {log.stat().st_size} bytes", flush=True)


if __name__ == "__main__":
    main()
