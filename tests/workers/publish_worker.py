"""One of several JAX processes (one CPU device each) writing one model as HuggingFace's
sharded safetensors with `save_safetensors`: some leaves sharded across the processes
(by rows, by columns), some replicated, a numpy leaf (process 0's copy is written),
bfloat16, int8, 0-d and empty ones. Started by tests/test_safetensors_processes.py and
benchmarks/publish.py.

    python publish_worker.py WHERE PORT NUM_PROCESSES PROCESS_ID DIRECTORY

WHERE: ``local`` (DIRECTORY/out), or ``s3``/``gcs`` (the servers named by
S3_TEST_ENDPOINT, S3_TEST_BUCKET, GCS_TEST_BUCKET; prefix PUBLISH_PREFIX). PUBLISH_MIB
sizes the state (default 2) and PUBLISH_SHARD its shard limit (`shard_limit`);
PUBLISH_OUT replaces the local directory, PUBLISH_OVERWRITE=1 passes overwrite=True, and
PUBLISH_SINGLE=1 writes one file, ``out.safetensors``, and
PUBLISH_KILL=K:S makes process K SIGKILL itself S seconds into the write (K:file: once
it has written its first file).
Prints ``REPORT {process, received, lacking, seconds, peak}``: the bytes this process was
sent, those of its files it did not hold, and its peak resident memory.
"""

import json
import os
import signal
import threading
import time
import zlib

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def layout(mib: float, processes: int) -> dict[str, tuple[tuple[int, ...], str, str]]:
    """``{path: (shape, dtype, kind)}``: kind ``rows``/``cols`` sharded across processes,
    ``rep`` replicated, ``host`` a numpy leaf."""
    rows = max(processes, int(mib * 1024 * 1024 / 4 / 512) // (4 * processes) * processes)
    return {
        "embed/weight": ((rows, 512), "float32", "rows"),
        "blocks/0/attn/q": ((512, rows // 2), "bfloat16", "cols"),
        "blocks/0/attn/norm": ((512,), "float32", "rep"),
        "blocks/0/mlp/w": ((rows // 2, 256), "bfloat16", "rows"),
        "blocks/0/mlp/scale": ((rows // 4, 64), "int8", "rep"),
        "blocks/1/mlp/w": ((rows // 2, 256), "float32", "rows"),
        "blocks/1/mlp/quant": ((rows, 32), "int8", "cols"),
        "head/bias": ((), "float32", "rep"),
        "head/empty": ((0, 4), "float32", "rep"),
        "vocab/ids": ((97,), "int32", "host"),
    }


def expected(path: str, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(path.encode()))
    if dtype == "int8" or dtype == "int32":
        return rng.integers(-100, 100, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)


def expected_tensors(mib: float, processes: int) -> dict[str, np.ndarray]:
    """The state dict the files must hold: names with dots, in the tree's order."""
    return {p.replace("/", "."): expected(p, s, d) for p, (s, d, _) in sorted(layout(mib, processes).items())}


def state(mib: float, mesh: Mesh) -> dict:
    out: dict = {}
    for path, (shape, dtype, kind) in layout(mib, mesh.size).items():
        value = expected(path, shape, dtype)
        node = out
        *parents, last = path.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        if kind == "host":
            # Every process passes its own copy; process 0's is written.
            node[last] = value if jax.process_index() == 0 else np.zeros_like(value)
            continue
        spec = {"rows": P("p"), "cols": P(None, "p"), "rep": P()}[kind]
        node[last] = jax.make_array_from_callback(shape, NamedSharding(mesh, spec), lambda i, v=value: v[i])
    return out


def shard_limit(mib: float) -> int:
    """The default shard limit: five or more files of the state, some tensors over it."""
    return int(mib * 1024 * 1024 * 0.07)


def location(where: str, directory: str):
    prefix = os.environ.get("PUBLISH_PREFIX", "published/")
    if where == "s3":
        return {
            "driver": "s3",
            "bucket": os.environ["S3_TEST_BUCKET"],
            "path": prefix,
            "endpoint": os.environ["S3_TEST_ENDPOINT"],
            "aws_region": "us-east-1",
            "aws_credentials": {"type": "environment"},
        }
    if where == "gcs":
        return {"driver": "gcs", "bucket": os.environ["GCS_TEST_BUCKET"], "path": prefix}
    return os.environ.get("PUBLISH_OUT", f"{directory}/out")


def count_received() -> list[int]:
    """From now on, ``counter[0]`` is the bytes this process was sent (`Transfers.fetch_arrays`)."""
    from eqxckpt._local import _peers

    received = [0]
    fetch = _peers.Transfers.fetch_arrays

    def counted(self, address, number, specs):
        got = fetch(self, address, number, specs)
        received[0] += sum(a.nbytes for a in got)
        return got

    _peers.Transfers.fetch_arrays = counted  # type: ignore[method-assign]
    return received


def count_lacking(process_id: int) -> list[int]:
    """From now on, ``counter[0]`` is the bytes of the files this process writes that it
    does not hold: all it may be sent."""
    from eqxckpt._formats._safetensors import _write

    lacking = [0]
    write = _write._Publishing.write

    def write_counted(self, shard, fetch=None):
        lacking[0] += sum(t.entry.nbytes - t.held(process_id) for t in self.files[shard][1])
        return write(self, shard, fetch)

    _write._Publishing.write = write_counted  # type: ignore[method-assign]
    return lacking


def peak_kib() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM")).split()[1])


def main(where: str, port: int, processes: int, process_id: int, directory: str) -> None:
    jax.config.update("jax_num_cpu_devices", 1)
    from distributed_worker import join

    join(port, processes, process_id)
    from jax.experimental import multihost_utils

    import eqxckpt

    received = count_received()
    lacking = count_lacking(process_id)
    mib = float(os.environ.get("PUBLISH_MIB", "2"))
    shard = int(os.environ.get("PUBLISH_SHARD", str(shard_limit(mib))))
    mesh = Mesh(np.array(jax.devices()), ("p",))
    tree = state(mib, mesh)
    multihost_utils.sync_global_devices("publishing")
    if kill := os.environ.get("PUBLISH_KILL"):
        victim, delay = kill.split(":")
        if int(victim) == process_id and delay == "file":
            from eqxckpt._storage._disk import LocalStorage

            put = LocalStorage.put_file

            def put_then_die(self, name, pieces, overwrite, seen=None):
                put(self, name, pieces, overwrite, seen)
                os.kill(os.getpid(), signal.SIGKILL)

            LocalStorage.put_file = put_then_die  # type: ignore[method-assign]
        elif int(victim) == process_id:
            threading.Timer(float(delay), lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    start = time.perf_counter()
    overwrite = os.environ.get("PUBLISH_OVERWRITE") == "1"
    if os.environ.get("PUBLISH_SINGLE") == "1":  # one file: process 0 writes it, sent what it lacks
        single = f"{location(where, directory)}.safetensors"
        eqxckpt.save_safetensors(single, tree, metadata={"format": "pt"}, overwrite=overwrite)
    else:
        eqxckpt.save_safetensors(
            location(where, directory), tree, max_shard_size=shard, metadata={"format": "pt"}, overwrite=overwrite
        )
    seconds = time.perf_counter() - start
    report = {"process": process_id, "received": received[0], "lacking": lacking[0], "seconds": seconds}
    report["peak"] = peak_kib()
    print("REPORT " + json.dumps(report), flush=True)
    multihost_utils.sync_global_devices("published")


if __name__ == "__main__":
    from distributed_worker import run_worker

    run_worker(main)
