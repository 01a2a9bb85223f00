"""Where a save of many small leaves spends its time, in one process.

    python benchmarks/save_phases.py --leaves 10000 --repeats 7

First the Python before the first write (`_plan`, `_snapshot`, `_pack` of `eqxckpt._write._save`,
the collector paused as a save pauses it; medians), then the timestamps of whole saves
(into a temporary directory): when planning ends, when the chunks are written, how long
the one ``syncfs`` takes, and the commit.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from workloads import build  # noqa: E402

import eqxckpt  # noqa: E402
import eqxckpt._storage._disk as local_module  # noqa: E402
import eqxckpt._write._save as save_module  # noqa: E402
from eqxckpt._gc import collector_paused  # noqa: E402


def planning(state, repeats: int) -> None:
    times = []
    for _ in range(repeats):
        with collector_paused():
            t0 = time.perf_counter()
            records, arrays = save_module._plan(state)
            t1 = time.perf_counter()
            jobs = save_module._snapshot(arrays, copy=False, leader=True)
            t2 = time.perf_counter()
            save_module._pack(records, jobs)
            t3 = time.perf_counter()
        times.append((t1 - t0, t2 - t1, t3 - t2))
    plan, snap, pack = (statistics.median(t[i] for t in times) * 1e3 for i in range(3))
    print(f"before the first write: plan {plan:.0f} ms, snapshot {snap:.0f} ms, pack {pack:.0f} ms")


def timestamps(state, repeats: int) -> None:
    marks: list[tuple[str, float]] = []

    def timed(owner, name: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            marks.append((f"{name} starts", time.perf_counter()))
            try:
                return original(*args, **kwargs)
            finally:
                marks.append((f"{name} ends", time.perf_counter()))

        setattr(owner, name, wrapper)

    timed(save_module, "_pack")
    timed(save_module, "_digested")
    timed(save_module, "_write")
    timed(local_module, "sync_filesystem")
    timed(local_module.LocalStaging, "commit")
    root = tempfile.mkdtemp(prefix="eqxckpt-phases-")
    try:
        for _ in range(repeats):
            shutil.rmtree(f"{root}/c", ignore_errors=True)
            os.sync()
            marks.clear()
            start = time.perf_counter()
            eqxckpt.save(f"{root}/c", state)
            total = time.perf_counter() - start
            print(f"save {total:.3f} s: " + ", ".join(f"{name} at {t - start:.3f} s" for name, t in marks))
    finally:
        shutil.rmtree(root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--leaves", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    state = build(f"leaves:{args.leaves}")
    planning(state, args.repeats)
    timestamps(state, 3)


if __name__ == "__main__":
    main()
