"""Saves onto a full disk; started by tests/test_concurrency.py inside its own mount namespace.

    unshare [--user --map-root-user] --mount python disk_full_worker.py OPTION DIRECTORY ROUNDS

Mounts a tmpfs with OPTION (``size=6m``, ``nr_inodes=60``) on DIRECTORY (the
namespace's own mount: it disappears with this process, and needs root only
inside the namespace), then checks ROUNDS saves that fill it. Exits non-zero
on the first failed check; prints ``rounds N`` at the end.
"""

import os
import subprocess
import sys

import numpy as np

import eqxckpt
import eqxckpt._chunks


def main(option: str, directory: str, rounds: int) -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", option, "tmpfs", directory], check=True)
    previous = {"w": np.arange(1000, dtype=np.float32)}
    eqxckpt.save(f"{directory}/ckpt", previous)
    # 16 MiB > 6 MiB, 64 leaves > 60 inodes; each leaf too big to be packed.
    big = {f"leaf{i}": np.full((256, 257), i, np.float32) for i in range(64)}
    # 12.5 MiB of small leaves, packed into one array of a few files: fills the bytes only.
    packed = {f"leaf{i}": np.full((128, 128), i, np.float32) for i in range(200)}
    # 12.6 MiB in one leaf written as 13 chunks (of 1 MiB here): a write of several chunks.
    chunked = {"w": np.full(3_300_000, 7.0, np.float32)}
    eqxckpt._chunks.CHUNK_BYTES = 1 << 20
    trees = [big, packed, chunked] if option.startswith("size") else [big]
    for round_ in range(rounds):
        try:
            eqxckpt.save(f"{directory}/ckpt", trees[round_ % len(trees)], overwrite=True)
            raise AssertionError("a save onto a full disk succeeded")
        except eqxckpt.CheckpointWriteError as e:
            assert "Nothing was committed" in str(e), e
        assert sorted(os.listdir(directory)) == ["ckpt"], os.listdir(directory)  # no temporary directory left
        np.testing.assert_array_equal(eqxckpt.load(f"{directory}/ckpt")["w"], previous["w"])
    eqxckpt.save(f"{directory}/ckpt", {"w": np.zeros(3)}, overwrite=True)  # the space came back
    print(f"rounds {rounds}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
