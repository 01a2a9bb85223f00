"""Two checkouts of eqxckpt against raw and the floor on the many-leaf workload, interleaved.

    python benchmarks/ab_leaves.py 10000 --repeats 3 --before /tmp/base --after .
    python benchmarks/ab_leaves.py 100000 --repeats 1 --ops save,restore --before /tmp/base --after .

Each operation is one `bench.py` worker (a fresh process, warm-up, prefaulted memory, values
checked), with ``PYTHONPATH`` set to the checkout measured; the order of the four rotates each
repeat, so that a busy machine's slow spells fall on all of them. Restores read a warm cache.
"""

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile

BENCH = pathlib.Path(__file__).resolve().parent / "bench.py"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("count", type=int)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ops", default="save,restore,verify")
    parser.add_argument("--before", required=True, help="checkout (directory holding eqxckpt/) measured first")
    parser.add_argument("--after", required=True)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    ops = args.ops.split(",")
    peers = {
        "raw": ("raw", None),
        "floor": ("floor", None),
        "before": ("eqxckpt", os.path.abspath(args.before)),
        "after": ("eqxckpt", os.path.abspath(args.after)),
    }
    root = pathlib.Path(tempfile.mkdtemp(prefix="eqxckpt-ab-", dir=args.dir))
    times: dict = {}

    def run(name: str, op: str, path: pathlib.Path) -> float:
        peer, checkout = peers[name]
        env = dict(os.environ, JAX_PLATFORMS="cpu", **({"PYTHONPATH": checkout} if checkout else {}))
        command = [sys.executable, str(BENCH), "--worker", peer, op, str(path), f"leaves:{args.count}"]
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])["seconds"]

    try:
        names = list(peers)
        for repeat in range(args.repeats):
            for name in names[repeat % 4 :] + names[: repeat % 4]:
                path = root / name
                for op in ops:
                    if op == "verify" and peers[name][0] != "eqxckpt":
                        continue
                    if op == "save":
                        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
                    elif not path.exists():
                        run(name, "save", path)
                    if op != "save":  # a warm cache
                        for file in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
                            file.read_bytes()
                    seconds = run(name, op, path)
                    times.setdefault(name, {}).setdefault(op, []).append(seconds)
                    print(f"repeat {repeat} {name:6} {op:8} {seconds:.3f} s", flush=True)
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def med(name: str, op: str) -> float:
        return statistics.median(times[name][op])

    for name in names:
        print(name, {op: round(statistics.median(ts), 3) for op, ts in times[name].items()})
    for name in ("before", "after"):
        line = f"{name}: save / raw {med(name, 'save') / med('raw', 'save'):.2f}x"
        if "restore" in ops:
            line += f", restore / raw {med(name, 'restore') / med('raw', 'restore'):.2f}x"
            line += f", restore / floor {med(name, 'restore') / med('floor', 'restore'):.2f}x"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
