"""cProfile of eqxckpt's save and restore on the benchmark workload.

    python benchmarks/profile_ops.py --mib 769 [--many-leaves 0] [--top 15]

Chunk reads and writes run on eqxckpt's I/O threads, which cProfile (main
thread only) sees as time waiting on their futures (``lock.acquire``), and
in ``syncfs``; the Python-side costs (planning, manifest, opening arrays,
making jax arrays) are listed by name.
"""

import argparse
import cProfile
import pathlib
import pstats
import shutil
import sys
import tempfile

import workloads  # beside this script

import eqxckpt  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, default=769)
    parser.add_argument("--many-leaves", type=int, default=0, help="profile the many-leaf state instead")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    if args.many_leaves:
        state, skeleton = (
            workloads.many_leaf_state(args.many_leaves),
            workloads.many_leaf_state(args.many_leaves, abstract=True),
        )
    else:
        state, skeleton = workloads.transformer_state(args.mib), workloads.transformer_state(args.mib, abstract=True)
    root = pathlib.Path(tempfile.mkdtemp(prefix="eqxckpt-profile-", dir=args.dir))
    try:
        for name, call in (
            ("save", lambda: eqxckpt.save(root / "ckpt", state)),
            ("restore", lambda: eqxckpt.load(root / "ckpt", skeleton)),
        ):
            profile = cProfile.Profile()
            profile.runcall(call)
            print(f"=== {name} ===")
            pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
