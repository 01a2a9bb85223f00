"""One of several JAX processes (one CPU device each) saving and restoring a state half
replicated on every process, half sharded across them; it prints the bytes it wrote and
read. Started by tests/test_distributed.py and benchmarks/replicas.py.

    python replica_worker.py WHERE PORT NUM_PROCESSES PROCESS_ID DIRECTORY

WHERE: ``local`` (DIRECTORY/ckpt), or ``s3``/``gcs`` (the servers named by
S3_TEST_ENDPOINT, S3_TEST_BUCKET, GCS_TEST_BUCKET; prefix REPLICA_PREFIX). REPLICATED_MIB and
SHARDED_MIB size the state (default 8 and 8). Counts: on a local disk, the bytes passed
to read and write calls (``/proc/self/io`` ``rchar``/``wchar``) and, apart, those of
chunk files alone; on object stores, TensorStore's kvstore byte counters.
"""

import json
import os
import zlib

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

ROW = 256  # float32 columns: a row is 1 KiB


def leaves(replicated_mib: int, sharded_mib: int, processes: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{path: (shape, kind)}``: kind ``r`` replicated, ``s`` sharded by rows, ``k`` PRNG keys.
    The replicated half: one leaf of half of it, the rest in smaller leaves of 1/8 and 1/32."""
    rows = replicated_mib * 1024
    shapes = {"rep/big": ((rows // 2, ROW), "r")}
    shapes.update({f"rep/mid{i}": ((rows // 8, ROW), "r") for i in range(3)})
    shapes.update({f"rep/small{i}": ((rows // 32, ROW), "r") for i in range(4)})
    shapes["rep/keys"] = ((8 * processes,), "k")
    shapes["shard/w"] = ((sharded_mib * 1024 // 2, ROW), "s")
    shapes["shard/v"] = ((sharded_mib * 1024 // 2, ROW), "s")
    return shapes


def expected(path: str, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(zlib.crc32(path.encode())).standard_normal(shape).astype(np.float32)


def expected_keys(shape: tuple[int, ...]) -> jax.Array:
    return jax.random.split(jax.random.key(3), shape[0])


def state(shapes: dict, mesh: Mesh, spec_of) -> dict:
    out = {}
    for path, (shape, kind) in shapes.items():
        sharding = NamedSharding(mesh, spec_of(path, kind))
        if kind == "k":
            out[path] = jax.jit(lambda n=shape[0]: expected_keys((n,)), out_shardings=sharding)()
        else:
            value = expected(path, shape)
            out[path] = jax.make_array_from_callback(shape, sharding, lambda i, v=value: v[i])
    return out


def skeleton(shapes: dict, mesh: Mesh, spec_of) -> dict:
    import jax.numpy as jnp

    out = {}
    for path, (shape, kind) in shapes.items():
        dtype = jax.random.key(0).dtype if kind == "k" else jnp.float32
        out[path] = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec_of(path, kind)))
    return out


def check(restored: dict, shapes: dict, like: dict) -> int:
    """Every value this process holds equals the saved one, bit for bit; count the elements."""
    checked = 0
    for path, (shape, kind) in shapes.items():
        value = restored[path]
        # PRNG keys restored into P() come back as P(None,) (as from a single process): the same placement.
        same = value.sharding.is_equivalent_to(like[path].sharding, len(shape)) if kind == "k" else None
        assert same or value.sharding == like[path].sharding, (path, value.sharding, like[path].sharding)
        want = np.asarray(jax.random.key_data(expected_keys(shape))) if kind == "k" else expected(path, shape)
        for shard in value.addressable_shards:
            data = jax.random.key_data(shard.data) if kind == "k" else shard.data
            got = np.asarray(data)
            assert got.tobytes() == want[shard.index].tobytes(), path
            checked += got.size
    return checked


class Counters:
    """Bytes this process wrote and read since the last `take`."""

    def __init__(self, where: str):
        self.where = where
        self.chunks = {"read": 0, "written": 0}
        if where not in ("s3", "gcs"):  # chunk files alone, apart from everything else
            import eqxckpt._storage._disk as local

            counts = self.chunks

            class Counted(local.LocalChunkFiles):
                def write(self, key, pieces):
                    super().write(key, pieces)
                    counts["written"] += sum(p.nbytes for p in pieces)

                def _read_ranges(self, key, ranges, size):
                    def counted():
                        for at, into in ranges:
                            yield at, into
                            counts["read"] += sum(b.nbytes for b in into)

                    super()._read_ranges(key, counted(), size)

            local.LocalChunkFiles = Counted  # type: ignore[misc]
        self.last = self.now()

    def now(self) -> dict[str, int]:
        if self.where in ("s3", "gcs"):
            import tensorstore as ts

            found = {"read": 0, "written": 0}
            for metric in ts.experimental_collect_matching_metrics(f"/tensorstore/kvstore/{self.where}/bytes_"):
                kind = "read" if metric["name"].endswith("bytes_read") else "written"
                found[kind] += sum(v.get("value", 0) for v in metric["values"])
            return found
        with open("/proc/self/io") as f:
            io = dict(line.split(": ") for line in f.read().splitlines())
        return {
            "read": int(io["rchar"]),
            "written": int(io["wchar"]),
            **{f"chunk_{k}": v for k, v in self.chunks.items()},
        }

    def take(self) -> dict[str, int]:
        now = self.now()
        delta = {k: now[k] - self.last.get(k, 0) for k in now}
        self.last = now
        return delta


def main(where: str, port: int, processes: int, process_id: int, directory: str) -> None:
    jax.config.update("jax_num_cpu_devices", 1)
    from distributed_worker import join

    join(port, processes, process_id)
    from jax.experimental import multihost_utils

    import eqxckpt

    counters = Counters(where)
    prefix = os.environ.get("REPLICA_PREFIX", "replicas/")
    if where == "s3":
        location = {
            "driver": "s3",
            "bucket": os.environ["S3_TEST_BUCKET"],
            "path": prefix,
            "endpoint": os.environ["S3_TEST_ENDPOINT"],
            "aws_region": "us-east-1",
            "aws_credentials": {"type": "environment"},
        }
    elif where == "gcs":
        location = {"driver": "gcs", "bucket": os.environ["GCS_TEST_BUCKET"], "path": prefix}
    else:
        location = f"{directory}/ckpt"
    shapes = leaves(int(os.environ.get("REPLICATED_MIB", "8")), int(os.environ.get("SHARDED_MIB", "8")), processes)
    devices = np.array(jax.devices())
    line = Mesh(devices, ("p",))
    square = Mesh(devices.reshape(2, processes // 2), ("a", "b")) if processes % 2 == 0 else None
    same = lambda path, kind: P("p") if kind == "s" else P()  # noqa: E731
    saved = state(shapes, line, same)
    multihost_utils.sync_global_devices("saving")
    counters.take()
    eqxckpt.save(location, saved)
    report = {"process": process_id, "save": counters.take()}
    del saved
    multihost_utils.sync_global_devices("restoring")
    counters.take()
    like = skeleton(shapes, line, same)
    restored = eqxckpt.load(location, like)
    report["load"] = counters.take()
    report["checked"] = check(restored, shapes, like)
    del restored
    # Another layout: replicated leaves sharded, sharded ones replicated.
    swapped = lambda path, kind: P() if kind == "s" else P("p")  # noqa: E731
    like = skeleton(shapes, line, swapped)
    report["checked"] += check(eqxckpt.load(location, like), shapes, like)
    if square is not None:  # a 2-D mesh: rows over "a", replicated over "b", which spans processes
        other = lambda path, kind: P("a") if kind in "rs" else P()  # noqa: E731
        like = skeleton(shapes, square, other)
        multihost_utils.sync_global_devices("square")
        counters.take()
        report["checked"] += check(eqxckpt.load(location, like), shapes, like)
        report["load_square"] = counters.take()
    print("REPORT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    from distributed_worker import run_worker

    run_worker(main)
