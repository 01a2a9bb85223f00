"""`verify` of large leaves on a warm cache: 1 GiB in 16 float32 leaves of 64 MiB.

    python benchmarks/verify_speed.py --repeats 5

One process: the checkpoint is saved and verified once (page cache warm), then
verified ``--repeats`` times; prints the median and GB/s.
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
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="eqxckpt-verify-")
    try:
        tree = {f"w{i}": np.random.default_rng(i).standard_normal((4096, 4096), np.float32) for i in range(16)}
        eqxckpt.save(f"{root}/c", tree)
        del tree
        eqxckpt.verify(f"{root}/c")  # the page cache warm
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            report = eqxckpt.verify(f"{root}/c")
            times.append(time.perf_counter() - start)
            assert report.ok, report
        median = statistics.median(times)
        print(
            f"verify 1 GiB (16 leaves of 64 MiB), warm cache: median {median:.3f} s = {2**30 / median / 1e9:.2f} GB/s "
            f"({', '.join(f'{t:.3f}' for t in times)})"
        )
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
