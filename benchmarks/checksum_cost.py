"""What TensorStore's crc32c codec costs: one leaf written and read as zarr3 with and
without the checksum, against raw file I/O, in one process, warm page cache.

    python benchmarks/checksum_cost.py --mib 64 --repeats 9

eqxckpt always writes the checksum (a corrupted chunk must never load as numbers);
this separates its cost from the rest of a save or restore.
"""

import argparse
import os
import pathlib
import shutil
import statistics
import tempfile
import time

import numpy as np
import tensorstore as ts

CODECS = {
    "zarr3 + crc32c": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
    "zarr3, no checksum": [{"name": "bytes", "configuration": {"endian": "little"}}],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    root = pathlib.Path(tempfile.mkdtemp(prefix="eqxckpt-crc-", dir=args.dir))
    data = np.random.default_rng(0).random(args.mib << 18, dtype=np.float32).reshape(64, -1)
    context = ts.Context(
        {"file_io_sync": False, "file_io_mode": {"mode": "memmap"}, "cache_pool": {"total_bytes_limit": 0}}
    )

    def spec(name: str, codecs: list | None) -> dict:
        kvstore = {"driver": "file", "path": f"{root}/{name}/"}
        if codecs is None:
            return {"driver": "zarr3", "kvstore": kvstore, "open": True}
        grid = {"name": "regular", "configuration": {"chunk_shape": list(data.shape)}}
        metadata = {"shape": list(data.shape), "data_type": "float32", "chunk_grid": grid, "codecs": codecs}
        return {"driver": "zarr3", "kvstore": kvstore, "metadata": metadata, "create": True, "delete_existing": True}

    times: dict[str, list[float]] = {}
    try:
        for _ in range(args.repeats):
            for name, codecs in CODECS.items():
                t0 = time.perf_counter()
                ts.open(spec(name, codecs), context=context).result().write(data).result()
                times.setdefault(f"write {name}", []).append(time.perf_counter() - t0)
                store = ts.open(spec(name, None), context=context).result()
                out = np.empty_like(data)
                t0 = time.perf_counter()
                ts.array(out, copy=False, write=True).write(store).result()
                times.setdefault(f"read {name}", []).append(time.perf_counter() - t0)
                assert np.array_equal(out, data)
            t0 = time.perf_counter()
            with open(root / "raw", "wb", buffering=0) as f:
                f.write(data.reshape(-1).view(np.uint8))
            times.setdefault("write raw", []).append(time.perf_counter() - t0)
            out = np.empty_like(data)
            t0 = time.perf_counter()
            with open(root / "raw", "rb", buffering=0) as f:
                f.readinto(out.reshape(-1).view(np.uint8))
            times.setdefault("read raw", []).append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.mib} MiB, one chunk, medians of {args.repeats} (min-max), seconds; {os.cpu_count()} cores")
    for name, values in sorted(times.items()):
        rate = args.mib / statistics.median(values)
        print(f"  {name:28} {statistics.median(values):.4f} ({min(values):.4f}-{max(values):.4f})  {rate:6.0f} MiB/s")


if __name__ == "__main__":
    main()
