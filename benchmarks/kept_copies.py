"""Disk cost of two physical copies (issue #53, item 8): a frozen 13.5 MiB backbone and a
0.5 MiB head that changes every step, 5 steps kept by `CheckpointManager`, with
``kept_copies=1``, ``kept_copies=2`` (the default) and ``incremental=False``; bytes on disk,
each file once however many steps link it.

    .venv/bin/python benchmarks/kept_copies.py
"""

import os
import tempfile

import numpy as np


def disk_bytes(root: str) -> int:
    seen, total = set(), 0
    for directory, _, files in os.walk(root):
        for name in files:
            info = os.stat(os.path.join(directory, name))
            if info.st_ino not in seen:
                seen.add(info.st_ino)
                total += info.st_size
    return total


def main() -> None:
    import eqxckpt

    backbone = np.random.default_rng(0).standard_normal((3456, 1024)).astype(np.float32)  # 13.5 MiB
    with tempfile.TemporaryDirectory() as scratch:
        for name, options in (
            ("kept_copies=1", dict(kept_copies=1)),
            ("kept_copies=2", dict(kept_copies=2)),
            ("incremental=False", dict(incremental=False)),
        ):
            run = os.path.join(scratch, name)
            with eqxckpt.CheckpointManager(run, max_to_keep=5, blocking=True, **options) as manager:
                for step in range(5):
                    manager.save(step, {"backbone": backbone, "head": np.full((256, 512), step, np.float32)})
            print(f"| {name} | {disk_bytes(run) / 2**20:.1f} MiB |")


if __name__ == "__main__":
    main()
