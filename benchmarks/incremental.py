"""Incremental checkpoints: a 1 GiB frozen base + a 16 MiB adapter with its adam state,
saved by `CheckpointManager` every step (durable, blocking), against saving the adapter
and its optimizer state alone (interleaved, each step's state built before the clock
starts); the check a step makes of the base before it shares it (issue #37); and a save
where every leaf changed, with and without a base to compare against. Medians over the
steps after the first.

    .venv/bin/python benchmarks/incremental.py
    .venv/bin/python benchmarks/incremental.py --gap 6

``--gap S``: S seconds between steps, outside the timed region (the training between
checkpoints). A step shares a checked leaf unread only once its files were written at
least 5 s before the check (`_storage._stamps.SETTLE_S`): without a gap, every step of
this short run checks the base.
"""

import argparse
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
from workloads import adapter_state, frozen_base  # beside this script


def disk_bytes(root: str, seen: set[int]) -> int:
    """Bytes of files under ``root`` not counted before (hard links count once)."""
    total = 0
    for directory, _, files in os.walk(root):
        for name in files:
            info = os.stat(os.path.join(directory, name))
            if info.st_ino not in seen:
                seen.add(info.st_ino)
                total += info.st_blocks * 512
    return total


def main() -> None:
    import jax

    parser = argparse.ArgumentParser()
    parser.add_argument("--gap", type=float, default=0.0, help="seconds between steps, untimed")
    gap = parser.parse_args().gap

    import eqxckpt

    # The frozen base as the jax.Arrays training holds (16 x 64 MiB); "numpy base" below
    # saves the same bytes as numpy arrays, which may change in place, so are hashed each step.
    base = frozen_base(1024)
    numpy_base = {k: np.asarray(v).copy() for k, v in base.items()}

    steps = 10
    with tempfile.TemporaryDirectory() as root:
        seen: set[int] = set()
        rows = []
        alone = []
        with eqxckpt.CheckpointManager(f"{root}/run", max_to_keep=steps, blocking=True) as manager:
            for step in range(steps):
                time.sleep(gap if step else 0.0)
                # Each step's state is built before the clock starts, and the adapter alone is
                # saved beside it, in turn first and second, so both see the same disk.
                state = adapter_state(step)
                jax.block_until_ready(state)
                for first in [True, False] if step % 2 else [False, True]:
                    start = time.perf_counter()
                    if first:
                        manager.save(step, {"base": base, **state}, force=True)
                        rows.append((time.perf_counter() - start, disk_bytes(f"{root}/run", seen)))
                    else:
                        eqxckpt.save(f"{root}/alone{step}", state)
                        alone.append((time.perf_counter() - start, disk_bytes(f"{root}/alone{step}", set())))
        total = disk_bytes(f"{root}/run", set())
        print(f"first step: {rows[0][0]:.2f} s, {rows[0][1] / 2**20:.0f} MiB written")
        later_s, later_b = statistics.median(r[0] for r in rows[1:]), statistics.median(r[1] for r in rows[1:])
        alone_s, alone_b = statistics.median(r[0] for r in alone[1:]), statistics.median(r[1] for r in alone[1:])
        print(f"later steps: {later_s:.3f} s, {later_b / 2**20:.1f} MiB written per step (median)")
        # The check a step makes before it shares the unchanged base (issue #37): every
        # chunk read and its CRC-32C checked, each leaf's digest computed, as `save` does.
        from eqxckpt._check._verify import damaged_leaves
        from eqxckpt._leaf import StoredLeaf
        from eqxckpt._stored import StoredArrays

        latest = StoredArrays.open(manager.path(steps - 1))
        shared = [r for r in latest.manifest.leaves if isinstance(r, StoredLeaf) and r.path.startswith("base/")]
        checks = []
        for _ in range(5):
            start = time.perf_counter()
            assert not damaged_leaves(latest, shared)
            checks.append(time.perf_counter() - start)
        print(
            f"check of the shared base before linking ({sum(r.nbytes for r in shared) / 2**20:.0f} MiB), "
            f"median of 5: {statistics.median(checks):.3f} s"
        )
        numpy_rows = []
        with eqxckpt.CheckpointManager(f"{root}/numpy_run", max_to_keep=steps, blocking=True) as manager_np:
            for step in range(steps):
                state = adapter_state(step)
                jax.block_until_ready(state)
                start = time.perf_counter()
                manager_np.save(step, {"base": numpy_base, **state}, force=True)
                numpy_rows.append(time.perf_counter() - start)
        print(f"later steps with a numpy base: {statistics.median(numpy_rows[1:]):.3f} s")
        print(f"adapter + optimizer alone: {alone_s:.3f} s, {alone_b / 2**20:.1f} MiB")
        print(f"ratio: time {later_s / alone_s:.2f}x, bytes {later_b / alone_b:.2f}x")
        print(
            f"disk for {steps} kept steps: {total / 2**20:.0f} MiB (one base + {steps} adapters: "
            f"{(rows[0][1] - alone_b + steps * alone_b) / 2**20:.0f} MiB)"
        )
        loads: dict[int, list[float]] = {0: [], steps - 1: []}
        for _ in range(3):  # alternately, after the saves above warmed the page cache alike
            for step in loads:
                start = time.perf_counter()
                eqxckpt.load(manager.path(step))
                loads[step].append(time.perf_counter() - start)
        print(
            f"restore, median of 3: step 0 (written whole) {statistics.median(loads[0]):.2f} s, "
            f"step {steps - 1} (mostly links) {statistics.median(loads[steps - 1]):.2f} s"
        )

        start = time.perf_counter()
        changes = eqxckpt.diff(manager.path(steps - 2), manager.path(steps - 1))
        adapter_bytes = sum(v.nbytes for v in jax.tree.leaves(adapter_state(0)))
        print(
            f"diff of steps {steps - 2} and {steps - 1} ({len(changes.unchanged)} leaves unchanged, "
            f"{len(changes.changed)} changed): {time.perf_counter() - start:.2f} s, read "
            f"{changes.bytes_read / 2**20:.1f} MiB = {changes.bytes_read / adapter_bytes:.2f}x the changed leaves' bytes"
        )

        # Async saves: what the caller waits for (the snapshot), with a base to compare
        # against (a manager's step) and without (a plain save of the same tree).
        blocked: dict[str, list[float]] = {"manager step (base)": [], "plain save (no base)": []}
        with eqxckpt.CheckpointManager(f"{root}/async_run", max_to_keep=2, blocking=False) as async_manager:
            for step in range(steps):
                state = {"base": base, **adapter_state(step)}
                jax.block_until_ready(state)
                for label in list(blocked)[:: 1 if step % 2 else -1]:
                    start = time.perf_counter()
                    if label.startswith("manager"):
                        async_manager.save(step, state, force=True)
                        blocked[label].append(time.perf_counter() - start)
                        async_manager.wait()
                    else:
                        handle = eqxckpt.save(f"{root}/async_plain{step}", state, blocking=False)
                        blocked[label].append(time.perf_counter() - start)
                        handle.wait()
                        shutil.rmtree(f"{root}/async_plain{step}")
        print(
            "async save, time the caller is blocked (median of steps 1-9): "
            + ", ".join(f"{label} {statistics.median(found[1:]) * 1e3:.1f} ms" for label, found in blocked.items())
        )

        # Every leaf changed: the cost of looking at a base that has nothing to give.
        changed = {"base": {k: v + 1 for k, v in base.items()}, **adapter_state(99)}
        jax.block_until_ready(changed)
        os.sync()  # the run's writes are on disk, not written back during these saves
        times = {"without base": [], "with base": []}
        for i in range(10):  # interleaved, first one then the other first; each removed once timed
            for label in list(times)[:: 1 if i % 2 else -1]:
                start = time.perf_counter()
                eqxckpt.save(
                    f"{root}/full{len(label)}_{i}",
                    changed,
                    base=None if label == "without base" else manager.path(steps - 1),
                )
                times[label].append(time.perf_counter() - start)
                shutil.rmtree(f"{root}/full{len(label)}_{i}")
        med = {label: statistics.median(found) for label, found in times.items()}
        print(
            f"full-change save: {med['with base']:.2f} s with a base, {med['without base']:.2f} s without "
            f"({med['with base'] / med['without base']:.3f}x)"
        )


if __name__ == "__main__":
    main()
