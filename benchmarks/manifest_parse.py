"""What a manifest costs per leaf: its bytes, the time to parse and check it (what
`eqxckpt.open` does before anything else), and that time with every leaf's record made.

The tree is `workloads.many_leaf_state` (``leaves:COUNT`` of `bench.py`: float32 leaves of
1-64 KiB, 100 to a block), saved once with numpy leaves; each parse runs in this process,
minimum and median of ``--repeats``. Run it on another checkout to compare
(``PYTHONPATH=<checkout> python benchmarks/manifest_parse.py``): it only calls
`eqxckpt.save` and `eqxckpt._manifest.parse_manifest`.

    python benchmarks/manifest_parse.py --leaves 10000 100000
"""

import argparse
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from workloads import many_leaf_state  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--leaves", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import numpy as np

    import eqxckpt
    from eqxckpt._manifest import parse_manifest

    print(f"eqxckpt at {pathlib.Path(eqxckpt.__file__).parent.parent}")
    print("| leaves | manifest bytes a leaf | parse µs a leaf (min / median) | with every record made |")
    print("|---|---|---|---|")
    for count in args.leaves:
        shapes = many_leaf_state(count, abstract=True)
        tree = __import__("jax").tree.map(lambda s: np.full(s.shape, 0.5, s.dtype), shapes)
        with tempfile.TemporaryDirectory() as scratch:
            eqxckpt.save(pathlib.Path(scratch) / "c", tree)
            raw = (pathlib.Path(scratch) / "c" / "eqxckpt.json").read_bytes()
        parse, whole = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            manifest = parse_manifest(raw)
            parse.append(time.perf_counter() - start)
            records = list(manifest.leaves)
            whole.append(time.perf_counter() - start)
            assert len(records) == count
            del manifest, records
        per = 1e6 / count
        print(
            f"| {count:,} | {len(raw) / count:.1f} | {min(parse) * per:.2f} / {statistics.median(parse) * per:.2f} "
            f"| {min(whole) * per:.2f} / {statistics.median(whole) * per:.2f} |"
        )


if __name__ == "__main__":
    main()
