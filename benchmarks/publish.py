"""Publishing a sharded model as HuggingFace safetensors from 4 JAX processes (one CPU
device each, on 127.0.0.1), against gathering it to process 0 and writing there, and
against one process writing the same files from memory.

    PYTHONPATH=. .venv/bin/python benchmarks/publish.py [--repeats 3] [--layers 28] [--shard 200MB]

The state: ``--layers`` transformer layers of width 1024 (q, k, v sharded by columns,
o by rows, float32; the MLP's up by columns and down by rows, bfloat16; a replicated
norm) and a 32768 x 1024 float32 embedding sharded by rows: 1 GiB at 28 layers.
Every run is a fresh set of processes; each prints its time (from a barrier before
the write to one after it), its peak resident memory over what it held before, the
bytes it was sent, and those of its files it did not hold. Peers, each writing the
same files, durable (fsync'd):

- ``eqxckpt``: every process calls ``eqxckpt.save_safetensors(dir, tree, max_shard_size=...)``.
- ``gather``: ``multihost_utils.process_allgather`` of every array (each process then
  holds the whole model), then process 0 writes the shards with
  ``safetensors.numpy.save_file`` as ``huggingface_hub`` splits them, and the index.
- ``one-eqxckpt`` / ``one-library``: one process holding the whole model in host
  memory writes the files with ``save_safetensors`` / with ``safetensors.numpy``.
- ``exchange``: what ``eqxckpt`` does with every file made and dropped, not written
  (nor the index): the blocks the writers lack sent and put together, the least a
  write of files by one process each costs beyond the writes.
"""

import argparse
import json
import os
import pathlib
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import zlib

HERE = pathlib.Path(__file__).resolve()
WORKERS = HERE.parent.parent / "tests" / "workers"
WIDTH, VOCAB = 1024, 32768


def layout(layers: int) -> dict[str, tuple[tuple[int, ...], str, str]]:
    """``{path: (shape, dtype, how)}``: how it is laid over the processes."""
    out = {"embed": ((VOCAB, WIDTH), "float32", "rows")}
    for i in range(layers):
        for name in ("q", "k", "v"):
            out[f"layers/{i}/attn/{name}"] = ((WIDTH, WIDTH), "float32", "cols")
        out[f"layers/{i}/attn/o"] = ((WIDTH, WIDTH), "float32", "rows")
        out[f"layers/{i}/mlp/up"] = ((WIDTH, 4 * WIDTH), "bfloat16", "cols")
        out[f"layers/{i}/mlp/down"] = ((4 * WIDTH, WIDTH), "bfloat16", "rows")
        out[f"layers/{i}/norm"] = ((WIDTH,), "float32", "rep")
    return out


def fill(path: str, shape: tuple[int, ...], dtype: str):
    import ml_dtypes
    import numpy as np

    return np.full(shape, zlib.crc32(path.encode()) % 251 / 7, ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)


def block_shape(index: tuple, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(len(range(*part.indices(n))) for part, n in zip(index, shape)) + tuple(shape[len(index) :])


def nest(flat: dict) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        *parents, last = path.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def peak_reset() -> int:
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return kib("VmRSS")


def kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field)).split()[1])


def write_with_library(directory: pathlib.Path, tensors: dict, limit: int) -> None:
    """The files as `huggingface_hub` splits them and `safetensors.numpy` writes them, durable."""
    import safetensors.numpy as stn
    from huggingface_hub import split_state_dict_into_shards_factory

    plan = split_state_dict_into_shards_factory(
        tensors, get_storage_size=lambda t: t.nbytes, filename_pattern="model{suffix}.safetensors", max_shard_size=limit
    )
    directory.mkdir(parents=True, exist_ok=True)
    for name, names in plan.filename_to_tensors.items():
        stn.save_file({n: tensors[n] for n in names}, str(directory / name), metadata={"format": "pt"})
    index = {"metadata": {**plan.metadata, "format": "pt"}, "weight_map": plan.tensor_to_filename}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def parse_limit(limit: str) -> int:
    from eqxckpt._formats._safetensors import parse_size

    return int(limit) if limit.isdigit() else parse_size(limit)


def worker(mode: str, port: int, processes: int, index: int, directory: str, layers: int, limit: int) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 1)
    out = pathlib.Path(directory) / "out"
    shapes = layout(layers)
    if mode.startswith("one-"):
        import eqxckpt

        flat = {p: fill(p, s, d) for p, (s, d, _) in shapes.items()}
        before = peak_reset()
        start = time.perf_counter()
        if mode == "one-eqxckpt":
            eqxckpt.save_safetensors(out, nest(flat), max_shard_size=limit, metadata={"format": "pt"}, progress=False)
        else:
            write_with_library(out, {p.replace("/", "."): v for p, v in sorted(flat.items())}, limit)
        seconds = time.perf_counter() - start
        report = {"process": 0, "seconds": seconds, "peak": (kib("VmHWM") - before) * 1024, "received": 0}
        print("REPORT " + json.dumps(report), flush=True)
        return
    sys.path.insert(0, str(WORKERS))
    from distributed_worker import join
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    join(port, processes, index)
    import numpy as np
    from publish_worker import count_lacking, count_received

    import eqxckpt

    received, lacking = count_received(), count_lacking(index)
    mesh = Mesh(np.array(jax.devices()), ("p",))
    specs = {"rows": P("p"), "cols": P(None, "p"), "rep": P()}
    flat = {}
    for path, (shape, dtype, how) in shapes.items():
        sharding = NamedSharding(mesh, specs[how])
        make = lambda i, p=path, s=shape, d=dtype: fill(p, block_shape(i, s), d)  # noqa: E731
        flat[path] = jax.make_array_from_callback(shape, sharding, make)
    # What this process holds (each distinct block once): the rest is what gathering sends it.
    held = sum(
        sum(s.data.nbytes for s in {str(s.index): s for s in v.addressable_shards}.values()) for v in flat.values()
    )
    total = sum(v.nbytes for v in flat.values())
    multihost_utils.sync_global_devices("start")
    before = peak_reset()
    start = time.perf_counter()
    if mode == "exchange":  # every file made, none written
        from eqxckpt._formats._safetensors import _write
        from eqxckpt._storage._disk import LocalStorage

        def made_not_written(self, name, pieces, overwrite, seen=None) -> str:
            for _ in pieces:
                pass
            return ""

        LocalStorage.put_file = made_not_written  # type: ignore[method-assign]
        _write._Publishing.commit = lambda self, stamps: None  # type: ignore[method-assign]
    if mode in ("eqxckpt", "exchange"):
        eqxckpt.save_safetensors(out, nest(flat), max_shard_size=limit, metadata={"format": "pt"}, progress=False)
    else:  # gather
        gathered = {
            p.replace("/", "."): np.asarray(multihost_utils.process_allgather(v, tiled=True))
            for p, v in sorted(flat.items())
        }
        received[0] = total - held
        if index == 0:
            write_with_library(out, gathered, limit)
        del gathered
    multihost_utils.sync_global_devices("done")
    seconds = time.perf_counter() - start
    report = {"process": index, "seconds": seconds, "peak": (kib("VmHWM") - before) * 1024, "received": received[0]}
    report["lacking"] = received[0] if mode == "gather" else lacking[0]
    print("REPORT " + json.dumps(report), flush=True)


def run(mode: str, processes: int, layers: int, limit: int) -> list[dict]:
    directory = tempfile.mkdtemp(prefix="eqxckpt-publish-")
    try:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
        count = 1 if mode.startswith("one-") else processes
        workers = [
            subprocess.Popen(
                [
                    sys.executable,
                    os.environ.get("PUBLISH_WRAP", str(HERE)),
                    "--worker",
                    mode,
                    str(port),
                    str(count),
                    str(i),
                    directory,
                ]
                + ["--layers", str(layers), "--shard", str(limit)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
                text=True,
            )
            for i in range(count)
        ]
        outputs = [w.communicate(timeout=900)[0] for w in workers]
        if any(w.returncode for w in workers):
            raise SystemExit("\n".join(o[-3000:] for o in outputs))
        return [json.loads(o.split("REPORT ", 1)[1].splitlines()[0]) for o in outputs]
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--shard", default="200MB")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--worker", nargs=5, default=None, metavar=("MODE", "PORT", "N", "I", "DIR"))
    args = parser.parse_args()
    limit = parse_limit(args.shard)
    if args.worker:
        mode, port, count, index, directory = args.worker
        worker(mode, int(port), int(count), int(index), directory, args.layers, limit)
        return
    state = sum(
        (4 if d == "float32" else 2) * s[0] * (s[1] if len(s) > 1 else 1) for s, d, _ in layout(args.layers).values()
    )
    modes = ["eqxckpt", "exchange", "gather", "one-eqxckpt", "one-library"]
    runs: dict[str, list[list[dict]]] = {m: [] for m in modes}
    for r in range(args.repeats):
        for mode in modes:
            print(f"  {mode} {r + 1}/{args.repeats}", file=sys.stderr, flush=True)
            runs[mode].append(run(mode, args.processes, args.layers, limit))
    mib = lambda n: f"{n / 2**20:.0f}"  # noqa: E731
    seconds = {m: statistics.median(max(r["seconds"] for r in reports) for reports in runs[m]) for m in modes}
    print(f"state {mib(state)} MiB, shards of at most {args.shard}, {args.processes} processes, {args.repeats} runs")
    print("| peer | time (s) | / one-library | / one-eqxckpt | peak over held (MiB) | sent to a process (MiB) |")
    print("|---|---|---|---|---|---|")
    for m in modes:
        peak = statistics.median(max(r["peak"] for r in reports) for reports in runs[m])
        received = statistics.median(max(r["received"] for r in reports) for reports in runs[m])
        print(
            f"| {m} | {seconds[m]:.2f} | {seconds[m] / seconds['one-library']:.2f}x | "
            f"{seconds[m] / seconds['one-eqxckpt']:.2f}x | {mib(peak)} | {mib(received)} |"
        )
    print(json.dumps({m: runs[m] for m in modes}))


if __name__ == "__main__":
    main()
