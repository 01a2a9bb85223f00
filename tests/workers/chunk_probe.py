"""Sharded saves on 4 CPU devices, whatever the shard lengths: every one loads back, in a
few chunks per budget's worth of bytes (hypothesis over shapes, shard counts, dtypes).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python chunk_probe.py DIR

Chunks of at most 4 KiB, so that shards of a prime number of rows (no divisor near the
budget) are common. Prints the number of saves checked.
"""

import math
import pathlib
import shutil
import sys
import uuid

import jax
import ml_dtypes
import numpy as np
from hypothesis import given, settings, strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import eqxckpt
import eqxckpt._chunks as chunks_module
from eqxckpt._chunks import MAX_CHUNK_FACTOR

BUDGET = 4096
SPLITS = {  # mesh shape, spec, how many shards along (rows, columns)
    "rows-4": ((4,), P("x"), (4, 1)),
    "rows-2-replicated": ((2, 2), P("x", None), (2, 1)),
    "grid": ((2, 2), P("x", "y"), (2, 2)),
    "columns-4": ((4,), P(None, "x"), (1, 4)),
}


def main(directory: str) -> None:
    chunks_module.CHUNK_BYTES = BUDGET
    checked = [0]

    @settings(max_examples=40, deadline=None, database=None, derandomize=True)
    @given(
        rows=st.sampled_from([1, 2, 3, 16, 17, 31, 97, 127, 257, 331]),
        columns=st.integers(1, 70),
        dtype=st.sampled_from([np.float32, np.int16, np.int8, np.bool_, ml_dtypes.bfloat16]),
        split=st.sampled_from(sorted(SPLITS)),
    )
    def case(rows: int, columns: int, dtype: type, split: str) -> None:
        mesh_shape, spec, (down, across) = SPLITS[split]
        mesh = Mesh(np.array(jax.devices()).reshape(mesh_shape), ("x", "y")[: len(mesh_shape)])
        sharding = NamedSharding(mesh, spec)
        shape = (rows * down, columns * across)
        value = (np.arange(math.prod(shape)).reshape(shape) % 251).astype(dtype)
        path = pathlib.Path(directory, uuid.uuid4().hex)
        try:
            check(path, value, sharding, down * across, few=down == 1 or across == 1)
        finally:
            shutil.rmtree(path, ignore_errors=True)
        checked[0] += 1

    case()
    print(checked[0])


def check(path: pathlib.Path, value: np.ndarray, sharding: NamedSharding, shards: int, few: bool) -> None:
    """Save ``value`` placed by ``sharding`` at ``path``; check both loads and, ``few`` (one
    dimension sharded: two prime shard lengths have no regular grid of few chunks), that it
    is cut into a few chunks per budget's worth of each shard."""
    shape = value.shape
    eqxckpt.save(path, {"w": jax.device_put(value, sharding)})
    files = [f for f in (path / "w").rglob("*") if f.is_file() and f.name != "zarr.json"]
    shard_bytes = value.nbytes // shards
    assert not few or len(files) <= shards * 2 * MAX_CHUNK_FACTOR * -(-shard_bytes // BUDGET), (
        f"{sharding.spec} {shape} {value.dtype.name}: {len(files)} chunk files"
    )
    like = {"w": jax.ShapeDtypeStruct(shape, value.dtype, sharding=sharding)}
    restored = eqxckpt.load(path, like)["w"]
    assert restored.sharding == sharding and np.array_equal(np.asarray(restored), value)
    assert np.array_equal(eqxckpt.load(path)["w"], value)


if __name__ == "__main__":
    main(sys.argv[1])
