"""Reading other libraries' checkpoints: eqxckpt against the libraries' own readers.

- a safetensors file into jax arrays: `safetensors.flax.load_file`,
  `safetensors.numpy.load_file` + `jax.device_put`, and `eqxckpt.load(file, skeleton)`
  (the skeleton of `jax.ShapeDtypeStruct` built from `eqxckpt.open(file)` inside the
  timed region);
- the same tensors as an Orbax checkpoint (default OCDBT layout) into jax
  arrays: Orbax's `StandardCheckpointer().restore` and `eqxckpt.load(dir)`.

Each read runs in a fresh process, after a warm-up read (warm page cache);
the time covers the read alone (not the imports). Medians of --repeats.

    python benchmarks/import_bench.py --mib 512 --repeats 3
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

READERS = {
    "safetensors": ["safetensors.flax.load_file", "safetensors.numpy.load_file+device_put", "eqxckpt"],
    "orbax": ["orbax.restore", "eqxckpt"],
}


def tensors(mib: float) -> dict:
    import ml_dtypes
    import numpy as np

    rng = np.random.default_rng(0)
    out, total, i = {}, 0, 0
    while total < mib * 2**20:
        shape = (1024, 2048) if i % 4 else (2048, 2048)
        value = rng.standard_normal(shape, np.float32)
        if i % 5 == 0:
            value = value.astype(ml_dtypes.bfloat16)
        out[f"model.layers.{i}.weight"] = value
        total += value.nbytes
        i += 1
    return out


def write(root: pathlib.Path, mib: float) -> None:
    import orbax.checkpoint as ocp
    import safetensors.numpy

    data = tensors(mib)
    safetensors.numpy.save_file(data, str(root / "model.safetensors"))
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(str(root / "orbax"), {k.replace(".", "_"): v for k, v in data.items()})
    checkpointer.wait_until_finished()


def read(kind: str, reader: str, root: pathlib.Path) -> float:
    """Seconds to read every tensor, in this process (imports done first)."""
    import jax
    import numpy as np

    import eqxckpt

    if reader.startswith("safetensors"):
        import safetensors.flax
        import safetensors.numpy
    if reader.startswith("orbax"):
        import orbax.checkpoint as ocp
    path = root / ("model.safetensors" if kind == "safetensors" else "orbax")
    start = time.perf_counter()
    if reader == "safetensors.flax.load_file":
        values = list(safetensors.flax.load_file(str(path)).values())
    elif reader == "safetensors.numpy.load_file+device_put":
        values = jax.device_put(list(safetensors.numpy.load_file(str(path)).values()))
    elif reader == "orbax.restore":
        values = jax.tree_util.tree_leaves(ocp.StandardCheckpointer().restore(str(path)))
    elif kind == "safetensors":
        skeleton = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), eqxckpt.open(path).tree())
        values = jax.tree_util.tree_leaves(eqxckpt.load(path, skeleton))
        assert all(isinstance(v, jax.Array) for v in values)
    else:
        values = jax.tree_util.tree_leaves(eqxckpt.load(path))
    jax.block_until_ready([v for v in values if isinstance(v, jax.Array)])
    took = time.perf_counter() - start
    assert sum(np.asarray(v).nbytes for v in values) > 0
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, reader, root = args.worker
        print(json.dumps(read(kind, reader, pathlib.Path(root))))
        return
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp).absolute()
        write(root, args.mib)
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
        for kind, readers in READERS.items():
            for reader in readers:
                times = []
                for i in range(args.repeats + 1):  # the first warms the page cache
                    out = subprocess.run(
                        [sys.executable, __file__, "--worker", kind, reader, str(root)],
                        capture_output=True,
                        text=True,
                        env=env,
                        check=True,
                    )
                    if i:
                        times.append(json.loads(out.stdout.strip().splitlines()[-1]))
                results[f"{kind}: {reader}"] = {
                    "median": statistics.median(times),
                    "min": min(times),
                    "max": max(times),
                }
    size = sum(v.nbytes for v in tensors(args.mib).values()) / 2**20
    print(
        f"reading other formats: {size:.0f} MiB; medians of {args.repeats} seconds, each in a fresh process, warm cache"
    )
    for name, r in results.items():
        print(f"  {name:32s} {r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})")
    for kind, readers in READERS.items():
        ours = results[f"{kind}: eqxckpt"]["median"]
        fastest = min(results[f"{kind}: {r}"]["median"] for r in readers if r != "eqxckpt")
        print(f"  {kind}: eqxckpt {ours:.3f} s, the faster peer {fastest:.3f} s ({ours / fastest:.2f}x)")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"mib": size, "results": results}, indent=1))


if __name__ == "__main__":
    main()
