"""Packed leaves: many small leaves stored as byte ranges of one zarr3 array, read back
exactly, lazily and partially, checked like every array, and refused when crafted."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import crafted_manifest, manifest_doc
from hypothesis import HealthCheck, given, settings, strategies as st

import eqxckpt
from eqxckpt._chunks import PACK_CHUNK_BYTES
from eqxckpt._leaf import ArrayLeaf
from eqxckpt._paths import PACK_ALIGNMENT, PACKED_LOCATION
from eqxckpt._write._pack import PACK_MAX_BYTES, PACK_MIN_LEAVES, PackedArray

DTYPES = [np.bool_, np.int8, np.uint16, np.int32, np.float16, ml_dtypes.bfloat16, np.float32, np.complex64]


def small_tree(count=PACK_MIN_LEAVES + 8, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "model": {f"w{i}": jnp.asarray(rng.standard_normal((i % 5 + 1, 7)), jnp.float32) for i in range(count)},
        "numpy": [rng.integers(-9, 9, size=(3, i + 1)).astype(np.int16) for i in range(4)],
        "big": jnp.asarray(rng.standard_normal((300, 300)), jnp.float32),  # 352 KiB: its own array
        "key": jax.random.key(4),
        "step": 7,
    }


def manifest(path):
    return manifest_doc((path / "eqxckpt.json").read_text())


def same(a, b):
    if isinstance(a, jax.Array) and jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
        a, b = jax.random.key_data(a), jax.random.key_data(b)
    assert type(a) is type(b) or isinstance(a, jax.Array) == isinstance(b, jax.Array), (type(a), type(b))
    assert np.asarray(a).dtype == np.asarray(b).dtype and np.array_equal(np.asarray(a), np.asarray(b))


def test_many_small_leaves_are_packed_and_restored_exactly(tmp_path):
    tree = small_tree()
    eqxckpt.save(tmp_path / "c", tree)
    doc = manifest(tmp_path / "c")
    assert doc["version"] == 5
    by_path = {leaf["path"]: leaf for leaf in doc["leaves"]}
    assert by_path["model/w0"]["location"] == PACKED_LOCATION
    assert by_path["key"]["location"] == PACKED_LOCATION  # PRNG key data packs too
    assert by_path["big"]["location"] == "big" and "offset" not in by_path["big"]
    offsets = [leaf["offset"] for leaf in doc["leaves"] if "offset" in leaf]
    assert offsets[0] == 0 and offsets == sorted(offsets) and all(o % PACK_ALIGNMENT == 0 for o in offsets)
    # No directory per packed leaf: the packed array, the big leaf, the manifest, the root group.
    assert sorted(os.listdir(tmp_path / "c")) == sorted([PACKED_LOCATION, "big", "eqxckpt.json", "zarr.json"])
    for a, b in zip(jax.tree.leaves(eqxckpt.load(tmp_path / "c", tree)), jax.tree.leaves(tree)):
        same(a, b)
    plain = eqxckpt.load(tmp_path / "c")
    same(plain["numpy"][2], tree["numpy"][2])
    assert eqxckpt.verify(tmp_path / "c").ok


def test_a_packed_chunk_of_more_leaves_than_one_writev_takes_is_written_whole(tmp_path):
    """A packed chunk is written from its leaves' own buffers and the zeros between them
    (`PackedWrite.gathered`): 3000 odd-sized leaves make about 6000 buffers in one chunk,
    more than one ``writev`` takes (1024 on Linux). Its bytes are what a chunk assembled
    in one buffer held: each leaf at its offset, zeros in every gap (read raw below)."""
    rng = np.random.default_rng(0)
    tree = {f"x{i:04d}": rng.standard_normal(int(rng.integers(1, 9))).astype(np.float32) for i in range(3000)}
    eqxckpt.save(tmp_path / "c", tree)
    doc = manifest(tmp_path / "c")
    leaves = {leaf["path"]: leaf for leaf in doc["leaves"]}
    assert all(leaf["location"] == PACKED_LOCATION for leaf in leaves.values())
    [chunk] = os.listdir(tmp_path / "c" / PACKED_LOCATION / "c")  # one chunk holds them all
    raw = (tmp_path / "c" / PACKED_LOCATION / "c" / chunk).read_bytes()[:-4]  # without the CRC-32C
    expected = np.zeros(len(raw), np.uint8)
    for path, value in tree.items():
        offset = leaves[path]["offset"]
        expected[offset : offset + value.nbytes] = value.view(np.uint8)
    assert np.array_equal(np.frombuffer(raw, np.uint8), expected)
    for path, value in eqxckpt.load(tmp_path / "c").items():
        np.testing.assert_array_equal(value, tree[path])
    assert eqxckpt.verify(tmp_path / "c").ok


def test_few_small_leaves_keep_their_own_arrays(tmp_path):
    tree = {f"w{i}": np.arange(i + 1, dtype=np.float32) for i in range(PACK_MIN_LEAVES - 1)}
    eqxckpt.save(tmp_path / "c", tree)
    doc = manifest(tmp_path / "c")
    assert all(leaf["location"] == leaf["path"] for leaf in doc["leaves"])
    assert not (tmp_path / "c" / PACKED_LOCATION).exists()


leaf_arrays = st.tuples(
    st.sampled_from(DTYPES),
    st.lists(st.integers(1, 9), max_size=3),
    st.integers(0, 2**32 - 1),
)


def expected(dtype, shape, seed):
    """Random bytes as ``dtype``: every bit pattern, NaNs included (bools are 0 or 1)."""
    raw = np.random.default_rng(seed).integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize)
    raw = raw % 2 if dtype is np.bool_ else raw
    return raw.astype(np.uint8).view(dtype).reshape(shape)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(leaf_arrays, min_size=PACK_MIN_LEAVES, max_size=PACK_MIN_LEAVES + 30), st.booleans())
def test_property_packed_round_trip(tmp_path_factory, specs, blocking):
    path = tmp_path_factory.mktemp("packed") / "c"
    arrays = [expected(*spec) for spec in specs]
    tree = {"a": arrays, "tail": np.ones((2, 2), np.float32)}
    eqxckpt.save(path, tree, blocking=blocking).wait()
    for a in arrays:
        a[...] = 0  # an async save holds its own copy
    stored = eqxckpt.load(path)
    for spec, got in zip(specs, stored["a"]):
        want = expected(*spec)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes()
    lazy = eqxckpt.open(path)
    for i in range(len(specs)):
        assert lazy[f"a/{i}"].get().tobytes() == stored["a"][i].tobytes()


def test_lazy_reads_slices_and_casts_of_packed_leaves(tmp_path):
    tree = small_tree()
    eqxckpt.save(tmp_path / "c", tree)
    ckpt = eqxckpt.open(tmp_path / "c")
    w = ckpt["model/w3"]
    assert w.shape == (4, 7) and w.nbytes == 4 * 7 * 4
    np.testing.assert_array_equal(w[1:3, ::2].get(), np.asarray(tree["model"]["w3"])[1:3, ::2])
    np.testing.assert_array_equal(w.astype("float16").get(), np.asarray(tree["model"]["w3"]).astype(np.float16))
    same(ckpt["key"].get(), tree["key"])


def test_packed_leaves_copy_into_a_new_checkpoint(tmp_path):
    tree = small_tree()
    eqxckpt.save(tmp_path / "c", tree)
    ckpt = eqxckpt.open(tmp_path / "c")
    eqxckpt.save(tmp_path / "d", {"w": ckpt["model/w2"], "part": ckpt["model/w4"][:2], "key": ckpt["key"]})
    out = eqxckpt.load(tmp_path / "d")
    np.testing.assert_array_equal(out["w"], np.asarray(tree["model"]["w2"]))
    np.testing.assert_array_equal(out["part"], np.asarray(tree["model"]["w4"])[:2])
    same(out["key"], tree["key"])


def params_and_state():
    """Model leaves in the first chunk of the packed array, optimizer leaves after it."""
    rng = np.random.default_rng(1)
    model = {f"p{i}": rng.standard_normal(16).astype(np.float32) for i in range(PACK_MIN_LEAVES)}
    state = {f"s{i}": rng.standard_normal(PACK_MAX_BYTES // 4).astype(np.float32) for i in range(40)}
    return {"model": model, "opt_state": state}


def test_partial_restore_reads_only_the_chunks_holding_its_leaves(tmp_path):
    tree = params_and_state()
    eqxckpt.save(tmp_path / "c", tree)
    chunks = sorted(os.listdir(tmp_path / "c" / PACKED_LOCATION / "c"), key=int)
    assert len(chunks) >= 3
    # Damage the last chunk: only optimizer leaves live there.
    last = tmp_path / "c" / PACKED_LOCATION / "c" / chunks[-1]
    raw = bytearray(last.read_bytes())
    raw[10] ^= 0xFF
    last.write_bytes(raw)
    model = eqxckpt.load(tmp_path / "c", tree["model"], at="model")
    for name, value in tree["model"].items():
        np.testing.assert_array_equal(model[name], value)
    with pytest.raises(eqxckpt.CorruptCheckpointError, match=PACKED_LOCATION):
        eqxckpt.load(tmp_path / "c", tree)
    with pytest.raises(eqxckpt.CorruptCheckpointError):
        eqxckpt.open(tmp_path / "c")[f"opt_state/s{39}"].get()
    # verify names exactly the leaves with bytes in the damaged chunk: optimizer leaves only.
    report = eqxckpt.verify(tmp_path / "c")
    start = int(chunks[-1]) * PACK_CHUNK_BYTES
    in_last = {
        leaf["path"]
        for leaf in manifest(tmp_path / "c")["leaves"]
        if leaf["offset"] + PACK_MAX_BYTES > start and leaf["path"].startswith("opt_state/")
    }
    damaged = {path for path, _ in report.problems}
    assert damaged == in_last and 0 < len(in_last) < len(tree["opt_state"])
    assert all("[" in message and PACKED_LOCATION in message for _, message in report.problems)


def packed_leaf(offset: int, nbytes: int) -> ArrayLeaf:
    return ArrayLeaf(f"l{offset}", (), (nbytes,), "uint8", "numpy", offset=offset)


def test_read_runs_cover_each_leaf_once_in_whole_chunks():
    c = PACK_CHUNK_BYTES
    leaves = [packed_leaf(0, 10), packed_leaf(c - 64, 128), packed_leaf(5 * c, 64), packed_leaf(64, 64)]
    packing = PackedArray(leaves)
    assert packing.length == 5 * c + 64
    runs = packing.runs(leaves)
    assert runs == [(0, 2 * c, [0, 3, 1]), (5 * c, 5 * c + 64, [2])]


def test_the_pieces_of_a_byte_range_are_the_members_with_bytes_in_it():
    c = PACK_CHUNK_BYTES
    leaves = [packed_leaf(0, 10), packed_leaf(c - 64, 128), packed_leaf(5 * c, 64), packed_leaf(64, 64)]
    packing = PackedArray(leaves)
    pieces = [(leaf.offset, own, there) for leaf, own, there in packing.pieces(c, 2 * c)]
    assert pieces == [(c - 64, slice(64, 128), slice(0, 64))]
    assert [leaf.offset for leaf, _, _ in packing.pieces(0, c)] == [0, 64, c - 64]
    assert list(packing.pieces(2 * c, 5 * c)) == []
    assert packing.ending_in(0, c) == 2 and packing.ending_in(c, 6 * c) == 2
    data = np.arange(c, dtype=np.uint64).view(np.uint8)[:c]
    assert all(data[there].size == own.stop - own.start for _, own, there in packing.pieces(0, c))
    moved = PackedArray([*leaves[:3], packed_leaf(128, 64)])
    assert packing.same_bytes_as(packing) is False  # no digests: not known to be the same

    def digested(p: PackedArray) -> PackedArray:
        return PackedArray([dataclasses.replace(m, digest="xxh3-128:" + "0" * 32) for m in p.members])

    assert digested(packing).same_bytes_as(digested(packing))
    assert not digested(packing).same_bytes_as(digested(moved))
    with pytest.raises(eqxckpt.ManifestError, match="overlapping bytes"):
        PackedArray([*leaves, packed_leaf(c, 64)]).check_ranges("here")


@pytest.mark.parametrize(
    "edit, error",
    [
        (lambda leaf: leaf.update(offset=3), eqxckpt.ManifestError),  # unaligned
        (lambda leaf: leaf.update(offset=-64), eqxckpt.ManifestError),
        (lambda leaf: leaf.update(offset="0"), eqxckpt.ManifestError),
        (lambda leaf: leaf.update(location=leaf["path"]), eqxckpt.ManifestError),  # own location with an offset
        (lambda leaf: leaf.pop("offset"), eqxckpt.ManifestError),
        # Far past the end: the packed array's zarr.json no longer fits what the manifest implies.
        (lambda leaf: leaf.update(offset=1 << 40), eqxckpt.CorruptCheckpointError),
    ],
)
def test_crafted_offsets_are_refused(tmp_path, edit, error):
    eqxckpt.save(tmp_path / "c", small_tree())
    doc = manifest(tmp_path / "c")
    edit(next(leaf for leaf in doc["leaves"] if leaf["path"] == "model/w7"))
    (tmp_path / "c" / "eqxckpt.json").write_bytes(crafted_manifest(doc))
    with pytest.raises(error):
        eqxckpt.load(tmp_path / "c")
    assert not eqxckpt.verify(tmp_path / "c").ok


def test_manifests_that_misuse_the_packed_location_are_refused(tmp_path):
    eqxckpt.save(tmp_path / "c", small_tree())
    original = manifest(tmp_path / "c")
    for edit, match in [
        (lambda doc: doc.update(version=1), "version 1 but has packed leaves"),
        # Its keys cannot spell it; were they checked less, the packed location's own check refuses it.
        (
            lambda doc: doc["leaves"][0].update(path=PACKED_LOCATION, keys=[["dict", PACKED_LOCATION]]),
            "spell|which no key's path can be",
        ),
    ]:
        doc = json.loads(json.dumps(original))
        edit(doc)
        (tmp_path / "c" / "eqxckpt.json").write_bytes(crafted_manifest(doc))
        with pytest.raises(eqxckpt.ManifestError, match=match):
            eqxckpt.load(tmp_path / "c")


def test_a_truncated_or_symlinked_packed_array_is_refused(tmp_path):
    eqxckpt.save(tmp_path / "c", small_tree())
    chunk = tmp_path / "c" / PACKED_LOCATION / "c" / "0"
    chunk.write_bytes(chunk.read_bytes()[:100])
    with pytest.raises(eqxckpt.CorruptCheckpointError, match="truncated"):
        eqxckpt.load(tmp_path / "c")
    eqxckpt.save(tmp_path / "d", small_tree())
    os.rename(tmp_path / "d" / PACKED_LOCATION, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", tmp_path / "d" / PACKED_LOCATION)
    with pytest.raises(eqxckpt.CorruptCheckpointError, match="symlink"):
        eqxckpt.load(tmp_path / "d")


def test_zarr_python_reads_a_packed_leaf_as_the_format_specification_says(tmp_path):
    zarr = pytest.importorskip("zarr")
    tree = small_tree()
    eqxckpt.save(tmp_path / "c", tree)
    leaf = next(leaf for leaf in manifest(tmp_path / "c")["leaves"] if leaf["path"] == "model/w9")
    packed = zarr.open_array(str(tmp_path / "c" / PACKED_LOCATION), mode="r")
    nbytes = int(np.prod(leaf["shape"])) * np.dtype(leaf["dtype"]).itemsize
    value = packed[leaf["offset"] : leaf["offset"] + nbytes].view(leaf["dtype"]).reshape(leaf["shape"])
    np.testing.assert_array_equal(value, np.asarray(tree["model"]["w9"]))


def test_packed_leaves_on_object_stores(store):
    tree = small_tree()
    where = store.spec("packed/c/")
    eqxckpt.save(where, tree)
    for a, b in zip(jax.tree.leaves(eqxckpt.load(where, tree)), jax.tree.leaves(tree)):
        same(a, b)
    assert eqxckpt.verify(where).ok
    np.testing.assert_array_equal(eqxckpt.open(where)["model/w1"].get(), np.asarray(tree["model"]["w1"]))


def test_the_packed_array_is_opened_once_per_checkpoint(tmp_path, monkeypatch):
    from eqxckpt._storage._disk import LocalStorage

    tree = small_tree()
    eqxckpt.save(tmp_path / "c", tree)
    opened = []
    real = LocalStorage.read_leaf_metadata
    monkeypatch.setattr(
        LocalStorage, "read_leaf_metadata", lambda self, leaf: opened.append(leaf.path) or real(self, leaf)
    )
    ckpt = eqxckpt.open(tmp_path / "c")
    for i in range(10):
        np.testing.assert_array_equal(ckpt[f"model/w{i}"].get(), np.asarray(tree["model"][f"w{i}"]))
    assert opened == [PACKED_LOCATION]


def test_overlapping_packed_leaves_are_refused_at_open_and_by_verify(tmp_path):
    eqxckpt.save(tmp_path / "c", small_tree())
    doc = manifest(tmp_path / "c")
    packed = [leaf for leaf in doc["leaves"] if leaf.get("offset") is not None]
    packed[1]["offset"] = packed[0]["offset"]  # two leaves on the same bytes
    (tmp_path / "c" / "eqxckpt.json").write_bytes(crafted_manifest(doc))
    with pytest.raises(eqxckpt.ManifestError, match="overlapping bytes"):
        eqxckpt.open(tmp_path / "c")
    report = eqxckpt.verify(tmp_path / "c")
    assert not report.ok and "overlapping bytes" in report.problems[0][1]


def _rewrite_packed_bytes(path, offset, data):
    """Write ``data`` into the packed array at ``offset`` through TensorStore (checksums stay valid)."""
    import tensorstore as ts

    store = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{path}/{PACKED_LOCATION}/"}}).result()
    store[offset : offset + len(data)].write(np.frombuffer(data, np.uint8)).result()


def test_a_packed_bool_byte_other_than_0_or_1_is_refused_on_read_and_by_verify(tmp_path):
    tree = small_tree()
    tree["flags"] = np.array([True, False, True])
    eqxckpt.save(tmp_path / "c", tree)
    [flags] = [leaf for leaf in manifest(tmp_path / "c")["leaves"] if leaf["path"] == "flags"]
    assert flags["offset"] is not None
    _rewrite_packed_bytes(tmp_path / "c", flags["offset"], b"\x01\x02\x01")
    # The leaf's digest (checked first, as its bytes are read) or, for a checkpoint without
    # digests, the bool bytes themselves.
    with pytest.raises(eqxckpt.CorruptCheckpointError, match="Leaf 'flags': its bytes pass their chunks' checksums"):
        eqxckpt.load(tmp_path / "c")
    doc = manifest(tmp_path / "c")
    for leaf in doc["leaves"]:
        leaf.pop("digest", None)
    (tmp_path / "c" / "eqxckpt.json").write_bytes(crafted_manifest(doc))
    with pytest.raises(eqxckpt.CorruptCheckpointError, match="Leaf 'flags': its bool data holds bytes"):
        eqxckpt.load(tmp_path / "c")
    with pytest.raises(eqxckpt.CorruptCheckpointError, match="Leaf 'flags'"):
        eqxckpt.open(tmp_path / "c")["flags"].get()
    report = eqxckpt.verify(tmp_path / "c")
    assert [path for path, _ in report.problems] == ["flags"]


def test_verify_names_exactly_the_leaves_whose_bytes_are_damaged(tmp_path):
    rng = np.random.default_rng(0)
    tree = {f"w{i:03d}": rng.standard_normal(50_000).astype(np.float32) for i in range(100)}  # 195 KiB each
    eqxckpt.save(tmp_path / "c", tree)
    chunk = tmp_path / "c" / PACKED_LOCATION / "c" / "1"  # bytes [4 MiB, 8 MiB)
    raw = bytearray(chunk.read_bytes())
    raw[1000] ^= 0x01
    chunk.write_bytes(bytes(raw))
    in_chunk = sorted(
        leaf["path"]
        for leaf in manifest(tmp_path / "c")["leaves"]
        if leaf["offset"] < 2 * PACK_CHUNK_BYTES and leaf["offset"] + 200_000 > PACK_CHUNK_BYTES
    )
    report = eqxckpt.verify(tmp_path / "c")
    assert sorted(path for path, _ in report.problems) == in_chunk
    assert 15 <= len(in_chunk) <= 25 and report.arrays_checked == 100 - len(in_chunk)
