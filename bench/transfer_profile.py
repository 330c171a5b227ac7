"""Where a transfer-port PUT or GET spends its time, in the agent and in the client.

Starts a real agent as ``bench/transfer.py`` does, drives one kind of request from client
threads for ``--seconds``, and samples both processes with py-spy (a sampling profiler that
reads another process's Python stacks; not a kvpool dependency: ``pip install py-spy``, and
it needs ptrace rights over the agent). Prints, per process, the busiest frames by samples
of their own and by samples under them, and the request rate, so the time per request of
each part can be read off:

    python bench/transfer_profile.py                          # 128 KiB blocks, PUT, 1 client
    python bench/transfer_profile.py --payload 2MiB --op get --clients 4 --top 30
    python bench/transfer_profile.py --path shm                # the same-node path

A sample is one stack of one thread that was running (idle threads are left out), taken
``--rate`` times a second.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from transfer import (  # bench/transfer.py
    GEOMETRIES,
    AgentProcess,
    bench_protocol,
    bench_shm,
    request_blocks,
)

OPS = ("put", "get")
PLUMBING = ("Thread._bootstrap", "Thread.run", "_run_code", "_run_module_as_main", "<module>")
"""Frames under which everything in a thread or a process runs (left out of "under")."""


def summarize(path: Path, top: int) -> None:
    """py-spy's raw output (``frame;frame;... count`` per line): the top frames by samples."""
    own: collections.Counter[str] = collections.Counter()
    under: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        frames = stack.split(";")
        total += n
        threads[frames[0]] += n
        own[frames[-1]] += n
        for frame in set(frames[1:]):
            if not frame.startswith(PLUMBING):
                under[frame] += n
    print(f"{total} samples; by thread: " + ", ".join(f"{t} {n}" for t, n in threads.items()))
    for title, counts in (("own", own), ("under", under)):
        print(f"  by samples {title}:")
        for frame, n in counts.most_common(top):
            print(f"    {100 * n / max(total, 1):5.1f}%  {frame}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--payload", choices=sorted(GEOMETRIES), default="128KiB")
    parser.add_argument("--op", choices=OPS, default="put")
    parser.add_argument("--clients", type=int, default=1)
    parser.add_argument(
        "--path", choices=("tcp", "shm"), default="tcp", help="transfer port or same-node path"
    )
    parser.add_argument("--blocks", type=int, default=16, help="2 MiB blocks' worth per request")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rate", type=int, default=200, help="samples per second")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    spy = shutil.which("py-spy")
    if spy is None:
        raise SystemExit("py-spy is not on PATH: pip install py-spy")
    model = GEOMETRIES[args.payload]
    block, blocks = request_blocks(model, args.blocks)
    nbytes = block * blocks
    with tempfile.TemporaryDirectory() as tmp:
        agent = AgentProcess(Path(tmp), model, max(512 << 20, 16 * nbytes), None)
        try:

            def bench(seconds: float, run: int) -> float:
                if args.path == "shm":
                    return bench_shm(agent.unix_socket, args.op, args.clients, blocks, seconds, run)
                return bench_protocol(agent.address, args.op, args.clients, blocks, seconds, run)

            bench(2.0, 0)  # warm-up
            outputs = {"agent": Path(tmp) / "agent.txt", "client": Path(tmp) / "client.txt"}
            pids = {"agent": agent.proc.pid, "client": os.getpid()}
            spies = [
                subprocess.Popen(
                    [spy, "record", "-p", str(pids[name]), "-d", str(int(args.seconds) + 1)]
                    + ["-r", str(args.rate), "--threads", "-f", "raw", "-o", str(out)]
                    + (["--nonblocking"] if name == "client" else []),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                for name, out in outputs.items()
            ]
            time.sleep(0.5)
            rate = bench(args.seconds, 1)
            for proc in spies:
                proc.wait()
        finally:
            agent.stop()
        per_request_ms = nbytes / rate * 1e3
        print(
            f"{args.path} {args.op} of {blocks} blocks of {args.payload} ({nbytes >> 20} MiB) from "
            f"{args.clients} client(s): {rate / 1e9:.2f} GB/s, {per_request_ms:.1f} ms per "
            f"request per client; one sample = {1e3 / args.rate:.0f} ms of a thread's time"
        )
        for name, out in outputs.items():
            print(f"\n== {name}")
            if out.exists():
                summarize(out, args.top)
            else:
                print("  no samples (py-spy could not attach: ptrace rights?)")


if __name__ == "__main__":
    main()
