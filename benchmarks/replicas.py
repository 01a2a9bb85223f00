"""Bytes each process writes and reads when 4 JAX processes (one CPU device each, on
127.0.0.1) save and restore 32 MiB replicated on every process plus 32 MiB sharded
across them (issue #38): `tests/workers/replica_worker.py`, on a local disk, counted by
``/proc/self/io`` (``wchar`` for the save; ``rchar`` for the restores, where gloo's
receives do not show but its sends do, in ``wchar``) and, apart, the chunk-file bytes.

    PYTHONPATH=. .venv/bin/python benchmarks/replicas.py [PROCESSES] [REPLICATED_MIB] [SHARDED_MIB]

Run with another checkout first on PYTHONPATH to measure it (the worker uses only
public API and the local chunk files' class).
"""

import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

WORKER = pathlib.Path(__file__).parent.parent / "tests" / "workers" / "replica_worker.py"


def run(processes: int, replicated: int, sharded: int, directory: str) -> list[dict]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    path = os.pathsep.join([os.environ.get("PYTHONPATH", ""), str(WORKER.parent)])
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=path, REPLICATED_MIB=str(replicated))
    env["SHARDED_MIB"] = str(sharded)
    logs = [pathlib.Path(directory) / f"worker{i}.log" for i in range(processes)]
    workers = []
    for i, log in enumerate(logs):
        with open(log, "wb") as out:
            command = [sys.executable, str(WORKER), "local", str(port), str(processes), str(i), directory]
            workers.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env))
    deadline = time.monotonic() + 600
    while any(w.poll() is None for w in workers):
        if any(w.poll() not in (None, 0) for w in workers) or time.monotonic() > deadline:
            for w in workers:
                if w.poll() is None:
                    w.kill()
            raise SystemExit("\n".join(log.read_text()[-3000:] for log in logs))
        time.sleep(0.1)
    return [json.loads(log.read_text().split("REPORT ", 1)[1].splitlines()[0]) for log in logs]


def main() -> None:
    processes, replicated, sharded = (int(a) for a in (sys.argv[1:] + ["4", "32", "32"][len(sys.argv) - 1 :]))
    with tempfile.TemporaryDirectory() as directory:
        reports = run(processes, replicated, sharded, directory)
    mib = lambda n: f"{n / 2**20:.1f}"  # noqa: E731
    print(f"{processes} processes, {replicated} MiB replicated + {sharded} MiB sharded (MiB per process)")
    print("| process | save wchar | save chunks | restore rchar | restore chunks | 2x2 restore rchar |")
    print("|---|---|---|---|---|---|")
    for r in reports:
        cells = [r["save"]["written"], r["save"]["chunk_written"], r["load"]["read"], r["load"]["chunk_read"]]
        square = mib(r["load_square"]["read"]) if "load_square" in r else "-"
        print(f"| {r['process']} | " + " | ".join(mib(c) for c in cells) + f" | {square} |")
    total = lambda phase, kind: sum(r[phase][kind] for r in reports)  # noqa: E731
    print(
        f"| all | {mib(total('save', 'written'))} | {mib(total('save', 'chunk_written'))} | "
        f"{mib(total('load', 'read'))} | {mib(total('load', 'chunk_read'))} | "
        + (mib(total("load_square", "read")) if "load_square" in reports[0] else "-")
        + " |"
    )


if __name__ == "__main__":
    main()
