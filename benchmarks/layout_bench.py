"""Restores that change the layout (`Stack`, `Unstack`) against plain restores of the same bytes.

A 24-layer transformer-like model (288 MiB of float32: per layer q, k, v, o 512x512,
w_in 512x2048, w_out 2048x512, a norm) is saved per-layer and scanned (each leaf
stacked over the layers), by eqxckpt and as a safetensors file. Each restore runs in a
fresh process (JAX started and eqxckpt imported first, then only `load` is timed, into a skeleton of
`jax.ShapeDtypeStruct`s, results on the default device); medians of 3 (the cases
interleaved), warm page cache.

    python benchmarks/layout_bench.py [--dir DIR] [--layers 24] [--repeats 3]

- plain per-layer:   per-layer checkpoint -> per-layer skeleton
- Stack:             per-layer checkpoint -> scanned skeleton, `Stack` rules
- load + jnp.stack:  per-layer checkpoint -> per-layer, then stacked in memory (today's way)
- plain scanned:     scanned checkpoint -> scanned skeleton
- Unstack:           scanned checkpoint -> per-layer skeleton, `Unstack` rules
"""

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

SHAPES = {
    "q": (512, 512),
    "k": (512, 512),
    "v": (512, 512),
    "o": (512, 512),
    "w_in": (512, 2048),
    "w_out": (2048, 512),
    "norm": (512,),
}
# Each: the files read, the skeleton's layout, the rules. A plain restore of the same files
# comes first: the others' ratios are to it.
CASES = {
    "plain per-layer": ("per_layer", "per_layer", None),
    "Stack": ("per_layer", "scanned", "stack"),
    "load + jnp.stack": ("per_layer", "per_layer", "in_memory"),
    "plain scanned": ("scanned", "scanned", None),
    "Unstack": ("scanned", "per_layer", "unstack"),
}


def skeleton(layout: str, layers: int):
    import jax
    import jax.numpy as jnp

    if layout == "scanned":
        return {"blocks": {name: jax.ShapeDtypeStruct((layers, *shape), jnp.float32) for name, shape in SHAPES.items()}}
    return {"blocks": [{n: jax.ShapeDtypeStruct(s, jnp.float32) for n, s in SHAPES.items()} for _ in range(layers)]}


def one(where: str, layout: str, rules: str | None, layers: int) -> float:
    """Time one restore in this (fresh) process."""
    import jax
    import jax.numpy as jnp

    import eqxckpt

    jax.devices()  # JAX started and the package's modules imported: only the restore is timed
    eqxckpt.load, eqxckpt.Stack  # noqa: B018 - imported on first use otherwise
    transforms = {
        "stack": {r"blocks/(.*)": eqxckpt.Stack(r"blocks/{i}/\1")},
        "unstack": {r"blocks/(\d+)/(.*)": eqxckpt.Unstack(r"blocks/\2", index=r"\1")},
    }.get(rules or "")
    start = time.perf_counter()
    out = eqxckpt.load(where, skeleton(layout, layers), transforms=transforms)
    if rules == "in_memory":
        out = {"blocks": {name: jnp.stack([block[name] for block in out["blocks"]]) for name in SHAPES}}
    jax.block_until_ready(out)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one", nargs=4, metavar=("WHERE", "LAYOUT", "RULES", "LAYERS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        where, layout, rules, layers = args.one
        print(json.dumps(one(where, layout, None if rules == "-" else rules, int(layers))))
        return
    import jax
    from safetensors.numpy import save_file

    import eqxckpt

    root = tempfile.mkdtemp(prefix="eqxckpt-layout-", dir=args.dir)
    try:
        rng = np.random.default_rng(0)
        blocks = [{n: rng.standard_normal(s, np.float32) for n, s in SHAPES.items()} for _ in range(args.layers)]
        scanned = {name: np.stack([block[name] for block in blocks]) for name in SHAPES}
        nbytes = sum(x.nbytes for x in scanned.values())
        to_jax = lambda tree: jax.tree.map(jax.device_put, tree)  # noqa: E731 - saved as jax arrays, restored so
        eqxckpt.save(f"{root}/per_layer", {"blocks": to_jax(blocks)})
        eqxckpt.save(f"{root}/scanned", {"blocks": to_jax(scanned)})
        flat_layers = {f"blocks.{i}.{n}": v for i, block in enumerate(blocks) for n, v in block.items()}
        save_file(flat_layers, f"{root}/per_layer.safetensors")
        save_file({f"blocks.{n}": v for n, v in scanned.items()}, f"{root}/scanned.safetensors")
        del blocks, scanned, flat_layers
        print(f"{args.layers} layers, {nbytes / 2**20:.0f} MiB; fresh process per restore, median of {args.repeats}")
        print("| restore | eqxckpt | vs plain restore of the same files | safetensors file | vs plain |")
        print("|---|---|---|---|---|")
        runs = {
            (case, fmt): [
                sys.executable,
                __file__,
                "--one",
                f"{root}/{saved}{suffix}",
                layout,
                rules or "-",
                str(args.layers),
            ]
            for case, (saved, layout, rules) in CASES.items()
            for fmt, suffix in (("eqxckpt", ""), ("safetensors", ".safetensors"))
        }
        for command in runs.values():
            subprocess.run(command, check=True, capture_output=True)  # the page cache warm
        times: dict[tuple[str, str], list[float]] = {run: [] for run in runs}
        for _ in range(args.repeats):  # interleaved: drift in the machine's speed falls on every case alike
            for run, command in runs.items():
                times[run].append(
                    json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
                )
        for case, (saved, _, _) in CASES.items():
            row = [case]
            for fmt in ("eqxckpt", "safetensors"):
                median = statistics.median(times[case, fmt])
                plain = next(
                    c for c, (s, _, r) in CASES.items() if s == saved and r is None
                )  # same files, read plainly
                ratio = median / statistics.median(times[plain, fmt])
                row += [f"{median:.3f} s ({nbytes / median / 2**30:.2f} GiB/s)", f"{ratio:.2f}x"]
            print("| " + " | ".join(row) + " |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
