"""Fed docs/lab/14-the-engine-in-its-own-process.md.

What one step's outputs cost to cross from the engine process to the front end.

A child process sends `--steps` batches of `--requests` one-token `StepOutput`s
(a decode step) plus an `EngineSnapshot`, as `engine/core_messages.StepBatch`;
the parent receives and rebuilds each. Printed: microseconds per batch, end to
end (encode, send, receive, decode), for

- `pipe-pickle`: a `multiprocessing` pipe, the dataclasses pickled whole (what
  carpool uses: new fields cross with no code);
The sender's encoding alone (`pickle.dumps` / `msgpack.packb` of the flattened
batch, in one process) is printed beside: it is what the engine's step pays.

- `zmq-msgpack`: a ZeroMQ PUSH/PULL socket over ipc, the dataclasses flattened
  to lists by their fields and packed with msgpack (vLLM V1's kind of transport).

pyzmq and msgpack are not carpool dependencies; for this measurement only:
    pip install --target /tmp/zmqmp pyzmq msgpack
    PYTHONPATH=/tmp/zmqmp python3 -m benchmarks.archive.transport
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import statistics
import tempfile
import time

from carpool.engine.commands import EngineSnapshot
from carpool.engine.core_messages import StepBatch
from carpool.outputs import EngineStats, StepOutput


def make_batch(num_requests: int, step: int) -> StepBatch:
    outputs = [StepOutput(f"cmpl-{i:032x}-0", [1000 + step], "", 128, step + 1)
               for i in range(num_requests)]
    stats = EngineStats(*([step] * 13), kv_cache_usage=0.5)
    return StepBatch(outputs, EngineSnapshot(stats, time.monotonic(), step), time.monotonic())


def _fields(obj) -> list:
    return [getattr(obj, f.name) for f in dataclasses.fields(obj)]


def _flatten(batch: StepBatch) -> list:
    snapshot = batch.snapshot
    return [[_fields(o) for o in batch.outputs],
            [_fields(snapshot.stats), snapshot.time, snapshot.num_requests_taken], batch.time]


def _rebuild(data: list) -> StepBatch:
    outputs, (stats, at, taken), t = data
    return StepBatch([StepOutput(*o) for o in outputs],
                     EngineSnapshot(EngineStats(*stats), at, taken), t)


def _pipe_sender(conn, num_requests: int, num_steps: int) -> None:
    for step in range(num_steps):
        conn.send(make_batch(num_requests, step))


def _zmq_sender(address: str, num_requests: int, num_steps: int) -> None:
    import msgpack
    import zmq
    socket = zmq.Context().socket(zmq.PUSH)
    socket.connect(address)
    for step in range(num_steps):
        socket.send(msgpack.packb(_flatten(make_batch(num_requests, step))))
    socket.close(linger=-1)


def time_pipe(num_requests: int, num_steps: int) -> float:
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_pipe_sender, args=(sender, num_requests, num_steps))
    child.start()
    receiver.poll(60)
    start = time.perf_counter()
    for _ in range(num_steps):
        receiver.recv()
    elapsed = time.perf_counter() - start
    child.join()
    return elapsed / num_steps


def time_zmq(num_requests: int, num_steps: int) -> float:
    import msgpack
    import zmq
    address = f"ipc://{tempfile.mkdtemp()}/bench.sock"
    socket = zmq.Context().socket(zmq.PULL)
    socket.bind(address)
    child = multiprocessing.get_context("spawn").Process(
        target=_zmq_sender, args=(address, num_requests, num_steps))
    child.start()
    socket.poll(60_000)
    start = time.perf_counter()
    for _ in range(num_steps):
        _rebuild(msgpack.unpackb(socket.recv(), use_list=True))
    elapsed = time.perf_counter() - start
    child.join()
    return elapsed / num_steps


def encode_times(num_requests: int, num: int = 500) -> tuple[float, float]:
    """Median microseconds to encode one batch: pickle, and flatten + msgpack."""
    import pickle

    import msgpack
    batch = make_batch(num_requests, 1)
    times: dict[str, list[float]] = {"pickle": [], "msgpack": []}
    for _ in range(num):
        start = time.perf_counter()
        pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
        middle = time.perf_counter()
        msgpack.packb(_flatten(batch))
        times["pickle"].append(middle - start)
        times["msgpack"].append(time.perf_counter() - middle)
    return (statistics.median(times["pickle"]) * 1e6, statistics.median(times["msgpack"]) * 1e6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"load: {os.getloadavg()[0]:.2f}")
    print("| requests per step | pipe-pickle us/step | zmq-msgpack us/step "
          "| encode: pickle us | encode: msgpack us |")
    print("|---|---|---|---|---|")
    for num_requests in args.requests:
        encode_pickle, encode_msgpack = encode_times(num_requests)
        pipe, zmq = [], []
        for _ in range(args.repeats):  # alternated
            pipe.append(time_pipe(num_requests, args.steps) * 1e6)
            zmq.append(time_zmq(num_requests, args.steps) * 1e6)
        print(f"| {num_requests} | {statistics.median(pipe):.0f} "
              f"({min(pipe):.0f}-{max(pipe):.0f}) | {statistics.median(zmq):.0f} "
              f"({min(zmq):.0f}-{max(zmq):.0f}) | {encode_pickle:.0f} | {encode_msgpack:.0f} |")


if __name__ == "__main__":
    main()
