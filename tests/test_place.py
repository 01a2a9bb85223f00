"""`_place.Placement`: a leaf put on its devices a band of rows at a time, bit for bit.

The device path (a buffer on the device, filled by a donated ``dynamic_update_slice``)
is what a GPU takes; `_place.STAGE_CPU` runs it on CPU devices, so it is checked here
without a GPU.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import eqxckpt
from eqxckpt._read import _place
from eqxckpt._read._place import Placement


@pytest.fixture(params=[False, True], ids=["host", "staged"])
def staged(request, monkeypatch):
    monkeypatch.setattr(_place, "STAGE_CPU", request.param)
    return request.param


def values(shape, dtype):
    rng = np.random.default_rng(sum(shape) + 7)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(np.bool_)
    if np.dtype(dtype).kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    return rng.standard_normal(shape).astype(dtype)


def reader(data):
    """A `Reader` over a host array, counting the elements it was asked for."""
    asked = []

    def read(pairs, window):
        for box, out in pairs:
            out[...] = data[tuple(slice(r.start, r.stop) for r in box)]
            asked.append(out.size)

    return read, asked


@pytest.mark.parametrize("shape", [(), (0, 3), (3, 0), (7,), (37, 5), (5, 4, 3)])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int8, np.bool_, np.uint32])
def test_placement_is_bit_exact_in_bands(staged, shape, dtype):
    data = values(shape, dtype)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    dtype = np.dtype(dtype)
    placement = Placement(shape, sharding, dtype, dtype, budget=2 * 3 * dtype.itemsize * 2)  # a few rows a band
    read, asked = reader(data)
    out = placement.run(lambda d: d, read, window=1 << 20)
    assert out.shape == shape and out.dtype == dtype
    assert np.array_equal(np.asarray(out).reshape(-1).view(np.uint8), data.reshape(-1).view(np.uint8))
    assert sum(asked) == data.size  # every element read once


def test_a_cast_is_done_band_by_band(staged):
    data = values((50, 6), np.float32)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    bands = []

    def convert(band):
        bands.append(band.shape[0])
        return band.astype(ml_dtypes.bfloat16)

    placement = Placement(data.shape, sharding, np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), budget=8 * 6 * 8)
    out = placement.run(convert, reader(data)[0], window=1 << 20, rows=4)
    assert out.dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(out).view(np.uint16), data.astype(ml_dtypes.bfloat16).view(np.uint16))
    assert bands == [8] * 6 + [2]  # bands of whole chunks' rows (4): 8 rows of 24 stored bytes, half the budget


@pytest.mark.parametrize("cast", [None, "bfloat16", "int16"])
def test_a_restore_larger_than_the_budget_is_bit_exact(staged, tmp_path, cast):
    """Through `load`: one device, a 4 KiB budget, as stored or cast; PRNG keys too."""
    w = (np.arange(30000, dtype=np.float32).reshape(300, 100) - 15000) / 4
    keys = jax.random.split(jax.random.key(3), 20000)
    eqxckpt.save(tmp_path / "c", {"w": w, "keys": keys, "b": np.ones(3, np.bool_)})
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    dtype = jnp.dtype(cast or "float32")
    like = {
        "w": jax.ShapeDtypeStruct(w.shape, dtype, sharding=one),
        "keys": jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=one),
        "b": jax.ShapeDtypeStruct((3,), jnp.bool_, sharding=one),
    }
    out = eqxckpt.load(tmp_path / "c", like, cast=cast is not None, host_memory_budget=4096)
    assert out["w"].dtype == dtype and out["w"].sharding == one
    assert np.array_equal(np.asarray(out["w"]).view(np.uint8), w.astype(dtype).view(np.uint8))
    assert np.array_equal(jax.random.key_data(out["keys"]), jax.random.key_data(keys))
    assert np.asarray(out["b"]).all()


def test_a_cast_that_does_not_fit_fails_naming_the_leaf(staged, tmp_path):
    w = np.full((300, 100), 1e6, np.float32)
    eqxckpt.save(tmp_path / "c", {"w": w})
    like = {"w": jax.ShapeDtypeStruct(w.shape, jnp.int16, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))}
    with pytest.raises(eqxckpt.CheckpointError, match="'w'.*int16"):
        eqxckpt.load(tmp_path / "c", like, cast=True, host_memory_budget=4096)


def test_an_upcast_at_the_default_ratio_of_budget_to_chunk_reads_each_chunk_once(staged, tmp_path, monkeypatch):
    """The default budget is 4 chunks (256 MiB, 64 MiB chunks); here scaled down (256 KiB,
    64 KiB). A bfloat16 leaf restored as float32 (mixed-precision master weights) costs 8
    bytes an element in a band (2 stored, 4 cast, 2 of checks), so a band of half the
    budget holds 64 of a chunk's 128 rows: bands no longer start on chunk boundaries and
    every chunk is read twice (int8 to float32: 3 to 4 times), twice the requests and
    egress on an object store."""
    from conftest import counting_storage

    from eqxckpt import _chunks
    from eqxckpt._read._checkpoint import open_checkpoint

    monkeypatch.setattr(_chunks, "CHUNK_BYTES", 64 << 10)
    w = values((1024, 256), ml_dtypes.bfloat16)  # 512 KiB: over the budget, 8 chunks of 128 rows
    eqxckpt.save(tmp_path / "c", {"w": w})
    storage, reads = counting_storage(tmp_path / "c")
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    like = {"w": jax.ShapeDtypeStruct(w.shape, jnp.float32, sharding=one)}
    out = eqxckpt.load(open_checkpoint(storage), like, cast=True, host_memory_budget=256 << 10)
    assert np.array_equal(np.asarray(out["w"]), w.astype(np.float32))
    assert reads == {f"w/c/{i}/0": 1 for i in range(8)}, reads


@pytest.mark.parametrize("kind", ["pinned_host", "unpinned_host"])
def test_a_target_in_host_memory_is_placed_there(staged, tmp_path, kind):
    """A target whose sharding names a host memory kind (offloaded optimizer state, say),
    restored in bands (larger than the budget, and cast): each band is put on the bare
    device (its default memory), and JAX refuses to assemble buffers of memory kind
    'device' into the target's sharding; the user is told the leaf is corrupt on disk.
    Restored whole (no bands) it works. The same for every sharding over several devices."""
    w = values((64, 8), np.float32)
    eqxckpt.save(tmp_path / "c", {"w": w})
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=kind)
    like = {"w": jax.ShapeDtypeStruct(w.shape, jnp.bfloat16, sharding=sharding)}
    out = eqxckpt.load(tmp_path / "c", like, cast=True, host_memory_budget=64)["w"]
    assert out.sharding == sharding
    assert np.array_equal(np.asarray(out).view(np.uint16), w.astype(ml_dtypes.bfloat16).view(np.uint16))


@pytest.mark.parametrize("cast", [None, "bfloat16"])
def test_a_restore_from_an_object_store_larger_than_the_budget_is_bit_exact(store, staged, monkeypatch, cast):
    """From S3 and Cloud Storage, a 4 KiB budget: each band of a leaf is placed from a chunk
    read as many ranged parts (`PART_BYTES` made 1000 bytes), as stored or cast; PRNG keys."""
    from eqxckpt._storage import _backend

    monkeypatch.setattr(_backend, "PART_BYTES", 1000)
    w = (np.arange(30000, dtype=np.float32).reshape(300, 100) - 15000) / 4
    keys = jax.random.split(jax.random.key(5), 2000)
    where = store.spec(f"place-{store.name}-{staged}-{cast}/")
    eqxckpt.save(where, {"w": w, "keys": keys})
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    dtype = jnp.dtype(cast or "float32")
    like = {
        "w": jax.ShapeDtypeStruct(w.shape, dtype, sharding=one),
        "keys": jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=one),
    }
    out = eqxckpt.load(where, like, cast=cast is not None, host_memory_budget=4096)
    assert out["w"].dtype == dtype
    assert np.array_equal(np.asarray(out["w"]).view(np.uint8), w.astype(dtype).view(np.uint8))
    assert np.array_equal(jax.random.key_data(out["keys"]), jax.random.key_data(keys))
