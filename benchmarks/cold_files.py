"""Cold reads of a checkpoint's chunk files against one file of the same bytes (root only:
the page cache is dropped before each read).

    python benchmarks/cold_files.py --mib 336 --repeats 3

Saves the benchmark's transformer state with eqxckpt into a temporary directory, then
reads its params' chunk files (``model/``, as a params-only restore reads them, without
the packed array) in plain Python: one after another, on 8 threads, and as one file
holding the same bytes. No eqxckpt code runs in the reads: this is what the VM's disk
allows, to set a params-only restore's cold time against.
"""

import argparse
import concurrent.futures
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from workloads import build  # noqa: E402

import eqxckpt  # noqa: E402


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def read_file(path: str) -> np.ndarray:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        data = np.empty(size, np.uint8)
        view, done = memoryview(data), 0
        while done < size:
            done += os.preadv(fd, [view[done:]], done)
        return data
    finally:
        os.close(fd)


def will_need(paths: list[str]) -> None:
    """Ask the kernel to start reading every file now (``POSIX_FADV_WILLNEED``)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, default=336)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="eqxckpt-cold-")
    try:
        eqxckpt.save(f"{root}/c", build(f"model:{args.mib}"))
        files = sorted(
            os.path.join(where, name)
            for where, _, names in os.walk(f"{root}/c/model")
            for name in names
            if name != "zarr.json"
        )
        with open(f"{root}/one", "wb") as out:
            for file in files:
                out.write(read_file(file))
        print(f"{len(files)} chunk files, {os.path.getsize(f'{root}/one') / 2**20:.0f} MiB")
        with (
            concurrent.futures.ThreadPoolExecutor(8) as pool,
            concurrent.futures.ThreadPoolExecutor(len(files)) as wide,
        ):
            ways = {
                "one file": lambda: read_file(f"{root}/one"),
                "files one after another": lambda: [read_file(f) for f in files],
                "files on 8 threads": lambda: list(pool.map(read_file, files)),
                "WILLNEED, then 8 threads": lambda: (will_need(files), list(pool.map(read_file, files))),
                "a thread per file": lambda: list(wide.map(read_file, files)),
            }
            times: dict[str, list[float]] = {name: [] for name in ways}
            for _ in range(args.repeats):
                for name, read in ways.items():
                    drop_caches()
                    start = time.perf_counter()
                    read()
                    times[name].append(time.perf_counter() - start)
        for name, measured in times.items():
            print(f"{name:24} median {statistics.median(measured):.3f} s ({', '.join(f'{t:.3f}' for t in measured)})")
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
