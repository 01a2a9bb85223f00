"""Does a params-only restore cost more when there is more to skip?

Saves 128 MiB of params next to an optimizer state 2x and 8x their size,
then times ``load(..., at="model")`` (median of 9, warm cache) for each.

    python benchmarks/skipped_bytes.py [--dir DIR]
"""

import argparse
import shutil
import statistics
import tempfile
import time

import jax
import numpy as np

import eqxckpt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="eqxckpt-skip-", dir=args.dir)
    rng = np.random.default_rng(0)
    params = {f"w{i}": jax.device_put(rng.standard_normal((1024, 1024), np.float32)) for i in range(32)}
    like = jax.eval_shape(lambda: params)
    try:
        for factor in (2, 8):
            path = f"{root}/x{factor}"
            opt = {f"m{i}": jax.device_put(np.full((1024, 1024), i, np.float32)) for i in range(32 * factor)}
            eqxckpt.save(path, {"model": params, "opt": opt})
            del opt
            eqxckpt.load(path, like, at="model")  # warm the cache
            times = []
            for _ in range(9):
                t0 = time.perf_counter()
                eqxckpt.load(path, like, at="model")
                times.append(time.perf_counter() - t0)
            print(
                f"optimizer state {factor}x the params ({32 * factor * 4} MiB in {32 * factor} leaves skipped): "
                f"params-only restore of 128 MiB {statistics.median(times):.3f} s (min {min(times):.3f})"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
