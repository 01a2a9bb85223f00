"""Chunk files, written and checked by eqxckpt itself (`_chunks`), are zarr v3 ``bytes`` +
``crc32c`` byte for byte: the same files TensorStore's codec wrote before, which
zarr-python and TensorStore still open and verify."""

import math
import os
import pathlib

import jax
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
import zarr
from conftest import assert_trees_equal, manifest_doc
from hypothesis import HealthCheck, given, settings, strategies as st

import eqxckpt
import eqxckpt._chunk_reads as chunk_reads
import eqxckpt._chunks as chunks_module
import eqxckpt._write._pack as pack_module
from eqxckpt._chunk_reads import read_chunk, read_into, read_scattered
from eqxckpt._chunks import (
    MAX_CHUNK_FACTOR,
    ChunkFileError,
    ChunkLayout,
    chunk_regions,
    chunk_shape,
    encode,
)
from eqxckpt._storage._backend import KvChunkFiles
from eqxckpt._storage._disk_chunks import LocalChunkFiles
from eqxckpt._window import blocking

BEFORE = pathlib.Path(__file__).parent / "fixtures" / "written_before_25"


def fixture_tree():
    """Every kind of chunk the writer makes, with 4 KiB chunks: several chunks with a
    padded edge chunk along rows and along the last dimension, one-byte dtypes, a
    scalar, an empty array, a PRNG key and packed small leaves."""
    rng = np.random.default_rng(25)
    return {
        "rows": rng.standard_normal((37, 50)).astype(np.float32),
        "wide": rng.standard_normal((3, 2000)).astype(np.float32),
        "cube": rng.integers(-9, 9, (5, 7, 90)).astype(np.int16),
        "half": rng.standard_normal(3000).astype(ml_dtypes.bfloat16),
        "nibbles": rng.integers(-8, 8, 3000).astype(ml_dtypes.int4),
        "flags": rng.random(5000) > 0.5,
        "z": (rng.standard_normal(700) + 1j * rng.standard_normal(700)).astype(np.complex64),
        "bytes": rng.integers(0, 256, 4097).astype(np.uint8),
        "scalar": np.float64(2.5),
        "empty": np.zeros((0, 3), np.float32),
        "key": jax.random.key(7),
        "nested": {"small": [rng.standard_normal(i + 1).astype(np.float32) for i in range(40)]},
    }


@pytest.fixture
def small_chunks(monkeypatch):
    """The layout `fixture_tree` was saved with: 4 KiB chunks, 1 KiB packed chunks."""
    monkeypatch.setattr(chunks_module, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(chunks_module, "PACK_CHUNK_BYTES", 1024)
    monkeypatch.setattr(pack_module, "PACK_MAX_BYTES", 1024)


def files_of(root: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_checkpoints_are_the_same_bytes_as_before(tmp_path, small_chunks):
    """`tests/fixtures/written_before_25` was saved by 368ac9b, whose chunks went through
    TensorStore's crc32c codec. The same tree saved today is the same files, byte for byte
    (the manifest differs only in its time and save id, in the checksum it begins with now,
    which the old one lacks, and in holding the same records as a table: an old manifest
    still loads), and the old checkpoint loads."""
    eqxckpt.save(tmp_path / "now", fixture_tree())
    before, now = files_of(BEFORE), files_of(tmp_path / "now")
    assert sorted(before) == sorted(now) and len(now) == 36
    for name in before:
        if name == "eqxckpt.json":
            old, new = manifest_doc(before[name]), manifest_doc(now[name])  # their leaves as records
            for varying in ("created_unix", "save_id"):
                assert old.pop(varying) != new.pop(varying)
            assert (old.pop("version"), new.pop("version")) == (2, 5)  # a record per leaf then, a table now
            assert "crc32c" not in old and len(new.pop("crc32c")) == 8
            assert old == new
        else:
            assert before[name] == now[name], name
    assert_trees_equal(eqxckpt.load(BEFORE, fixture_tree()), fixture_tree())
    assert eqxckpt.verify(BEFORE).ok


DTYPES = [np.float32, np.float64, np.int8, np.uint16, np.complex128, np.bool_, ml_dtypes.bfloat16, ml_dtypes.int4]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple),
    budget=st.integers(1, 200),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_chunk_files_are_what_tensorstore_writes(tmp_path_factory, dtype, shape, budget, seed):
    """Any shape and dtype, any chunk shape `chunk_shape` picks (edges padded along any
    dimension): `encode` gives TensorStore's files, and `read_chunk` reads them back."""
    root = tmp_path_factory.mktemp("chunks")
    dtype = np.dtype(dtype)
    raw = np.random.default_rng(seed).integers(0, 256, int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    if dtype in (np.bool_, ml_dtypes.int4):
        raw &= 1
    data = raw.view(dtype).reshape(shape)
    layout = ChunkLayout(shape, dtype, tuple(chunk_shape(shape, dtype.itemsize, budget=budget)))
    ours = LocalChunkFiles(str(root / "ours"))
    ours.write("x/zarr.json", [np.frombuffer(layout.zarr_json(), np.uint8)])
    for key, part in layout.regions():
        ours.write(f"x/{key}", encode(layout, part, data[part]))
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(root / "theirs" / "x") + "/"},
        "metadata": layout.metadata(),
        "store_data_equal_to_fill_value": True,
        "create": True,
    }
    ts.open(spec).result().write(data).result()
    assert files_of(root / "ours") == files_of(root / "theirs")
    back = np.empty(shape, dtype)
    for key, part in layout.regions():
        blocking(read_chunk(ours, f"x/{key}", layout, part, back[(*part, ...)]))
    assert back.tobytes() == data.tobytes()


def test_zarr_python_and_tensorstore_read_every_array_and_catch_a_flipped_byte(tmp_path, small_chunks):
    tree = fixture_tree()
    eqxckpt.save(tmp_path / "c", tree)
    plain = ["rows", "wide", "cube", "flags", "z", "bytes"]  # dtypes zarr-python knows
    for name in plain:
        expected = np.asarray(tree[name])
        np.testing.assert_array_equal(zarr.open_array(str(tmp_path / "c" / name), mode="r")[...], expected)
        store = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "c" / name)}}).result()
        np.testing.assert_array_equal(store.read().result(), expected)
    packed = zarr.open_array(str(tmp_path / "c" / "%packed"), mode="r")[...]
    manifest = manifest_doc((tmp_path / "c" / "eqxckpt.json").read_text())
    first = next(leaf for leaf in manifest["leaves"] if leaf["path"] == "nested/small/3")
    got = packed[first["offset"] : first["offset"] + 16].view(np.float32)
    np.testing.assert_array_equal(got, tree["nested"]["small"][3])

    chunk = tmp_path / "c" / "rows" / "c" / "1" / "0"  # the padded edge chunk
    damaged = bytearray(chunk.read_bytes())
    damaged[5] ^= 0x10
    chunk.write_bytes(bytes(damaged))
    with pytest.raises(Exception, match="(?i)checksum"):
        zarr.open_array(str(tmp_path / "c" / "rows"), mode="r")[...]
    store = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "c" / "rows")}}).result()
    with pytest.raises(ValueError, match="(?i)digest mismatch|checksum"):
        store.read().result()
    with pytest.raises(eqxckpt.CorruptCheckpointError, match="rows/c/1/0 fails its CRC-32C checksum"):
        eqxckpt.load(tmp_path / "c", tree)
    report = eqxckpt.verify(tmp_path / "c")
    assert [path for path, _ in report.problems] == ["rows"]


def test_a_chunk_file_of_the_wrong_size_or_missing_is_named(tmp_path):
    layout = ChunkLayout((4,), np.dtype(np.float32), (4,))
    files = LocalChunkFiles(str(tmp_path))
    files.write("x/c/0", encode(layout, (slice(0, 4),), np.arange(4, dtype=np.float32)))
    out = np.empty(4, np.float32)
    os.truncate(tmp_path / "x" / "c" / "0", 19)
    with pytest.raises(ChunkFileError, match="x/c/0 holds 19 bytes, not 20"):
        blocking(read_chunk(files, "x/c/0", layout, (slice(0, 4),), out))
    os.remove(tmp_path / "x" / "c" / "0")
    with pytest.raises(ChunkFileError, match="x/c/0 is missing"):
        blocking(read_chunk(files, "x/c/0", layout, (slice(0, 4),), out))
    os.symlink("/etc/passwd", tmp_path / "x" / "c" / "0")
    with pytest.raises(ChunkFileError, match="cannot be read"):
        blocking(read_chunk(files, "x/c/0", layout, (slice(0, 4),), out))


def _selection(draw, extent: tuple[int, ...]) -> tuple[slice, ...]:
    """A selection of each dimension of ``extent``: a start, a stop past it and a step."""
    take = []
    for n in extent:
        start = draw(st.integers(0, n - 1))
        take.append(slice(start, draw(st.integers(start + 1, n)), draw(st.integers(1, 3))))
    return tuple(take)


@pytest.mark.parametrize("where", ["disk", "kvstore"])
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    dtype=st.sampled_from([np.float32, np.int8, np.complex128, ml_dtypes.bfloat16]),
    shape=st.lists(st.integers(1, 9), min_size=0, max_size=3).map(tuple),
    budget=st.integers(1, 200),
    slab_bytes=st.integers(1, 64),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_property_a_chunk_read_a_slab_at_a_time_gives_any_selection_and_catches_a_flipped_byte(
    tmp_path_factory, where, dtype, shape, budget, slab_bytes, seed, data
):
    """A selection (steps too) of a chunk, or columns of it for two buffers, is read a slab
    at a time (`read_slabs`: the restore split by columns held a buffer of the whole
    chunk, 64 MiB beyond its budget), from a disk and from a kvstore, with slabs as small as
    one index: every value in place, and a byte flipped anywhere in the file is caught."""
    dtype = np.dtype(dtype)
    values = np.random.default_rng(seed).integers(0, 256, math.prod(shape) * dtype.itemsize, dtype=np.uint8)
    values = values.view(dtype).reshape(shape)
    layout = ChunkLayout(shape, dtype, tuple(chunk_shape(shape, dtype.itemsize, budget=budget)))
    if where == "disk":
        files = LocalChunkFiles(str(tmp_path_factory.mktemp("slabs")))
    else:
        files = KvChunkFiles(ts.KvStore.open({"driver": "memory"}).result())
    key, part = data.draw(st.sampled_from(list(layout.regions())))
    files.write(f"x/{key}", encode(layout, part, values[part]))
    extent = tuple(s.stop - s.start for s in part)
    take = _selection(data.draw, extent)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(chunk_reads, "SLAB_BYTES", slab_bytes)
        patch.setattr(chunk_reads, "MIN_SLAB_BYTES", 1)  # slabs of one index, or part of one
        into = np.empty(values[part][take].shape, dtype)
        blocking(read_into(files, f"x/{key}", layout, part, take, into))
        assert into.tobytes() == values[part][take].tobytes()
        if extent and extent[-1] > 1:  # two buffers taking the columns on each side of a cut
            cut = data.draw(st.integers(1, extent[-1] - 1))
            sides = [(*(slice(0, n) for n in extent[:-1]), slice(a, b)) for a, b in ((0, cut), (cut, extent[-1]))]
            targets = [(side, np.empty(values[part][side].shape, dtype)) for side in sides]
            blocking(read_scattered(files, f"x/{key}", layout, part, targets))
            assert all(got.tobytes() == values[part][side].tobytes() for side, got in targets)
        raw = bytearray(b"".join(piece.tobytes() for piece in encode(layout, part, values[part])))
        raw[data.draw(st.integers(0, len(raw) - 1))] ^= 1 << data.draw(st.integers(0, 7))
        files.write(f"x/{key}", [np.frombuffer(bytes(raw), np.uint8)])
        with pytest.raises(ChunkFileError, match="fails its CRC-32C checksum"):
            blocking(read_into(files, f"x/{key}", layout, part, take, np.empty_like(into)))


def test_a_chunk_read_in_slabs_opens_its_file_once_and_never_blocks_on_a_fifo(tmp_path):
    """The outside attack on the slab reader: each slab opened the file again, so a file
    renamed over it between slabs was read as a mix (caught only by the checksum), and a
    FIFO put in its place blocked the open forever. One open file now serves every slab,
    and anything but a regular file is refused at once. A budget of one byte still reads
    slabs of `MIN_SLAB_BYTES` (one byte at a time took seconds per MiB)."""
    from conftest import release_fifo, returns_within

    from eqxckpt._window import limited_host_memory

    layout = ChunkLayout((64, 64), np.dtype(np.float32), (64, 64))
    whole = (slice(0, 64), slice(0, 64))
    values = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    files = LocalChunkFiles(str(tmp_path))
    files.write("w/c/0/0", encode(layout, whole, values))
    files.write("other", encode(layout, whole, values + 1))
    opened: list[int] = []

    class Counted(LocalChunkFiles):
        def _read_ranges(self, key, ranges, size):
            def counting():
                for at, into in ranges:
                    opened.append(at)
                    yield at, into

            super()._read_ranges(key, counting(), size)

    swapped = {"done": False}
    original = LocalChunkFiles._read_ranges

    def swapping(self, key, ranges, size):
        def after_first():
            for n, item in enumerate(ranges):
                yield item
                if n == 0 and not swapped["done"]:
                    os.replace(tmp_path / "other", tmp_path / "w" / "c" / "0" / "0")
                    swapped["done"] = True

        original(self, key, after_first(), size)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(chunk_reads, "SLAB_BYTES", 1024)
        patch.setattr(chunk_reads, "MIN_SLAB_BYTES", 1024)
        patch.setattr(LocalChunkFiles, "_read_ranges", swapping)
        out = np.empty((32, 22), np.float32)
        blocking(read_into(files, "w/c/0/0", layout, whole, (slice(0, 64, 2), slice(0, 64, 3)), out))
        assert swapped["done"] and out.tobytes() == values[::2, ::3].tobytes()  # the file first opened, whole
        patch.setattr(LocalChunkFiles, "_read_ranges", original)
        os.remove(tmp_path / "w" / "c" / "0" / "0")
        os.mkfifo(tmp_path / "w" / "c" / "0" / "0")
        fifo = tmp_path / "w" / "c" / "0" / "0"
        with pytest.raises(ChunkFileError, match="is not a regular file"):
            returns_within(
                lambda: blocking(read_into(files, "w/c/0/0", layout, whole, (slice(0, 64, 2), slice(0, 64)), out)),
                release=lambda: release_fifo(fifo),
            )
    os.remove(fifo)
    big = ChunkLayout((1 << 20,), np.dtype(np.int8), (1 << 20,))
    counted = Counted(str(tmp_path))
    counted.write("b/c/0", encode(big, (slice(0, 1 << 20),), np.zeros(1 << 20, np.int8)))
    with limited_host_memory(1):
        half = np.empty(1 << 19, np.int8)
        blocking(read_into(counted, "b/c/0", big, (slice(0, 1 << 20),), (slice(0, 1 << 20, 2),), half))
    assert opened == [0], opened  # one slab of 1 MiB, not a million of one byte


@pytest.mark.parametrize(
    "shape,itemsize,budget,expected",
    [
        ((), 4, 64, []),
        ((0, 5), 4, 64, [1, 5]),
        ((10,), 4, 64, [10]),
        ((100,), 4, 64, [16]),
        ((8, 8), 4, 64, [2, 8]),
        ((4, 100), 4, 64, [1, 16]),
        ((3, 4, 5), 8, 10**9, [3, 4, 5]),
    ],
)
def test_chunk_shape_is_contiguous_and_bounded(shape, itemsize, budget, expected):
    chunk = chunk_shape(shape, itemsize, budget=budget)
    assert chunk == expected
    assert np.prod(chunk, dtype=int) * itemsize <= max(budget, itemsize)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 6), st.integers(1, 40)), min_size=1, max_size=3),
    st.sampled_from([1, 2, 4, 8]),
    st.integers(1, 4096),
)
def test_chunks_never_straddle_shards(dims, itemsize, budget):
    # dims: (shards along the dimension, shard length); the global length is their product.
    shard = tuple(length for _, length in dims)
    shape = tuple(count * length for count, length in dims)
    chunk = chunk_shape(shape, itemsize, shard, budget=budget)
    # Within the budget, or (a shard length with no divisor near it) the smallest divisor
    # above it with the dimensions after it cut to fit, within a small factor of it.
    nbytes = math.prod(chunk) * itemsize
    assert nbytes <= max(budget, itemsize) * MAX_CHUNK_FACTOR
    for dim, part, size in zip(shape, shard, chunk):
        assert 0 < size <= part
        if part < dim:  # sharded: every chunk boundary falls inside one shard
            assert part % size == 0
    # A few chunks per budget's worth of each shard, never one per row (#53: a prime
    # number of rows per shard was cut into one-row chunks that a load then refused), where
    # such a layout exists: one dimension sharded, a row along any dimension within budget.
    if sum(count > 1 for count, _ in dims) <= 1 and budget >= itemsize * max(shard):
        per_shard = math.prod(-(-p // c) for p, c in zip(shard, chunk))
        assert per_shard <= 2 * MAX_CHUNK_FACTOR * -(-math.prod(shard) * itemsize // budget)


@pytest.mark.parametrize(
    "shape,shard,chunk",
    [
        ((262142, 256), (131071, 256), [131071, 128]),  # a prime number of rows per shard: 2 chunks, not 131071
        ((16787 * 4, 1000), (16787, 1000), [16787, 500]),  # the columns split evenly, not 999 + 1
        ((131071 * 2,), (131071,), [131071]),  # no other dimension to cut: the shard whole
        ((1024, 1024), (512, 1024), [512, 1024]),  # a divisor near the budget: as before
        ((2042, 131458), (1021, 65729), [1, 65729]),  # both prime: rows of a shard, as before (not [1021, 1])
    ],
)
def test_a_shard_length_without_a_divisor_near_the_budget_is_cut_in_a_few_chunks(shape, shard, chunk):
    assert chunk_shape(shape, 4, shard) == chunk
    layout = ChunkLayout(shape, np.dtype("float32"), tuple(chunk))
    assert layout.refusal() is None  # each loads


@given(st.lists(st.tuples(st.integers(0, 9), st.integers(1, 4), st.integers(0, 3)), max_size=3))
def test_chunk_regions_tile_the_region_chunk_by_chunk(dims):
    """Every element of the region is in exactly one part, and no part crosses a chunk boundary."""
    chunk = [c for _, c, _ in dims]
    region = [slice(k * c, k * c + n) for n, c, k in dims]  # starting on a chunk boundary
    parts = chunk_regions(chunk, region)
    covered = np.zeros([s.stop for s in region] or [], np.int32)
    for part in parts:
        assert all(p.start // c == (p.stop - 1) // c for p, c in zip(part, chunk))
        covered[part] += 1
    inside = covered[tuple(region)]
    assert inside.size == 0 or (inside == 1).all()
    assert covered.sum() == inside.size


@pytest.mark.multiprocess
def test_every_sharded_save_loads_back_in_a_few_chunks_per_budget(tmp_path):
    """On 4 CPU devices (a worker process), hypothesis over shard lengths (primes among
    them), columns, dtypes and splits: every save loads back bit-exact, and one sharded by
    one dimension in at most a few chunk files per budget's worth of each shard (#53:
    one-row chunks a load refused)."""
    from conftest import WORKERS, on_devices

    out = on_devices(4, [str(WORKERS / "chunk_probe.py"), str(tmp_path)], timeout=600)
    assert out.strip().splitlines()[-1] == "40"
