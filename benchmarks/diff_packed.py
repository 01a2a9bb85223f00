"""`diff` of many changed small (packed) leaves on a warm cache (issue #37).

    python benchmarks/diff_packed.py --leaves 6000 --repeats 3

Two checkpoints of ``--leaves`` float32 leaves of 1 KiB each, every one of them
changed, so every leaf is packed and must be read on both sides. Prints the time
to open and load both sides (the floor: every byte read once) and `diff`'s median.
"""

import argparse
import shutil
import statistics
import tempfile
import time

import numpy as np

import eqxckpt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--leaves", type=int, default=6000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="eqxckpt-diff-")
    try:
        rng = np.random.default_rng(0)
        a = {f"w{i}": rng.standard_normal(256).astype(np.float32) for i in range(args.leaves)}
        b = {path: value + 1 for path, value in a.items()}
        eqxckpt.save(f"{root}/a", a)
        eqxckpt.save(f"{root}/b", b)
        start = time.perf_counter()
        eqxckpt.load(f"{root}/a")
        eqxckpt.load(f"{root}/b")
        loaded = time.perf_counter() - start
        times, result = [], None
        for _ in range(args.repeats):
            start = time.perf_counter()
            result = eqxckpt.diff(f"{root}/a", f"{root}/b")
            times.append(time.perf_counter() - start)
            assert len(result.changed) == args.leaves and not result.unchanged, result
        assert result is not None
        print(
            f"{args.leaves} changed 1 KiB leaves: load both {loaded:.3f} s, diff median {statistics.median(times):.3f} s "
            f"({', '.join(f'{t:.3f}' for t in times)}; {result.bytes_read} bytes read)"
        )
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
