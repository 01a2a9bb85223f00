"""Leaf digests: what the format specification says they are, computed as bytes arrive
in any split, recorded by every single-process save, and parsed strictly."""

import json

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import xxhash
from conftest import crafted_manifest, manifest_doc
from hypothesis import given, settings, strategies as st

import eqxckpt
from eqxckpt._digest import LeafDigest, digest
from eqxckpt._write._pack import PACK_MIN_LEAVES


def by_the_spec(fields: list, data: np.ndarray) -> str:
    """docs/format.md#digests, written out independently of eqxckpt's code."""
    head = json.dumps(fields, separators=(",", ":")).encode() + b"\0"
    return (
        "xxh3-128:"
        + xxhash.xxh3_128(head + np.ascontiguousarray(data).astype(data.dtype.newbyteorder("<")).tobytes()).hexdigest()
    )


DTYPES = st.sampled_from([np.bool_, np.int8, np.uint16, np.int64, np.float16, np.float32, np.float64, np.complex64])


@settings(max_examples=60, deadline=None)
@given(data=hnp.arrays(DTYPES, hnp.array_shapes(min_dims=0, max_dims=3, max_side=7)), split=st.integers(1, 7))
def test_a_digest_is_the_specs_hash_however_the_bytes_arrive(data, split):
    fields = ["array", data.dtype.name, list(data.shape)]
    expected = by_the_spec(fields, data)
    assert digest(fields, data) == expected
    streamed = LeafDigest(fields)
    rows = data.reshape(-1) if data.ndim == 0 else data
    for start in range(0, max(1, len(rows)), split):
        streamed.update(rows[start : start + split])
    assert streamed.value == expected
    big_endian = data.astype(data.dtype.newbyteorder(">"))
    assert digest(fields, big_endian) == expected  # the bytes as stored: little-endian


def test_the_same_bytes_as_another_dtype_shape_or_kind_differ():
    data = np.arange(12, dtype=np.float32).reshape(4, 3)
    base = digest(["array", "float32", [4, 3]], data)
    assert digest(["array", "float32", [3, 4]], data.reshape(3, 4)) != base
    assert digest(["array", "int32", [4, 3]], data.view(np.int32)) != base
    assert digest(["prng_key", "float32", [4, 3], "threefry2x32"], data) != base
    assert digest(["array", "float32", [4, 3]], data) == base


def test_descriptions_equal_in_python_but_not_in_json_hash_apart():
    # Started hashes are remembered per description: [1], [True] and [1.0] are equal lists.
    data = np.zeros(1, np.uint8)
    variants = [["array", "uint8", [1]], ["array", "uint8", [True]], ["array", "uint8", [1.0]]]
    expected = [by_the_spec(fields, data) for fields in variants]
    assert len(set(expected)) == 3
    for _ in range(2):  # the second time from what was remembered
        assert [digest(fields, data) for fields in variants] == expected
    streamed = LeafDigest(variants[0])
    streamed.update(data)
    assert streamed.value == expected[0] and digest(variants[0], np.ones(1, np.uint8)) != expected[0]


NAMES = st.one_of(st.sampled_from(["array", "prng_key", "float32", "bfloat16"]), st.text(max_size=6))
SHAPES = st.lists(st.one_of(st.integers(-3, 10**12), st.booleans(), st.floats(0, 4)), max_size=4)


@settings(max_examples=200, deadline=None)
@given(kind=NAMES, dtype=NAMES, shape=SHAPES, extra=st.lists(NAMES, max_size=1))
def test_a_description_is_hashed_as_its_compact_json(kind, dtype, shape, extra):
    # Usual descriptions are written without the encoder; any other goes through it.
    fields = [kind, dtype, shape, *extra]
    data = np.arange(3, dtype=np.uint8)
    assert digest(fields, data) == by_the_spec(fields, data)


def test_every_stored_leaf_of_a_save_has_the_specs_digest(tmp_path):
    tree = {
        "w": jnp.arange(12, dtype=jnp.bfloat16).reshape(4, 3),
        "flags": np.array([True, False, True]),
        "scalar": np.float64(2.5),
        "key": jax.random.key(3),
        "big": np.ones((300, 300), np.float32),
        "many": [np.full(i + 1, i, np.int16) for i in range(PACK_MIN_LEAVES)],
        "step": 7,
    }
    eqxckpt.save(tmp_path / "c", tree)
    manifest = manifest_doc((tmp_path / "c/eqxckpt.json").read_text())
    leaves = {leaf["path"]: leaf for leaf in manifest["leaves"]}
    assert "offset" in leaves["many/0"] and "offset" not in leaves["big"]  # both packed and own arrays
    values = {
        "w": np.asarray(tree["w"]).astype(ml_dtypes.bfloat16),
        "flags": tree["flags"],
        "scalar": np.asarray(tree["scalar"]),
        "key": np.asarray(jax.random.key_data(tree["key"])),
        "big": tree["big"],
        **{f"many/{i}": leaf for i, leaf in enumerate(tree["many"])},
    }
    for path, value in values.items():
        leaf = leaves[path]
        fields = [leaf["kind"], leaf["dtype"], list(value.shape)] + (
            [leaf["impl"]] if leaf["kind"] == "prng_key" else []
        )
        assert leaf["digest"] == by_the_spec(fields, value), path
    assert "digest" not in leaves["step"]
    # The same tree saved again: the same digests; a copied leaf keeps its source's, a sliced one has none.
    eqxckpt.save(tmp_path / "again", tree)
    again = {leaf["path"]: leaf for leaf in manifest_doc((tmp_path / "again/eqxckpt.json").read_text())["leaves"]}
    assert all(again[path]["digest"] == leaves[path]["digest"] for path in values)
    source = eqxckpt.open(tmp_path / "c")
    eqxckpt.save(tmp_path / "copy", {"same": source["big"], "part": source["big"][:10]})
    copied = {leaf["path"]: leaf for leaf in manifest_doc((tmp_path / "copy/eqxckpt.json").read_text())["leaves"]}
    assert copied["same"]["digest"] == leaves["big"]["digest"] and "digest" not in copied["part"]
    assert eqxckpt.verify(tmp_path / "copy").ok


def test_digests_are_parsed_strictly_and_unknown_algorithms_ignored(tmp_path):
    eqxckpt.save(tmp_path / "c", {"w": np.ones(3, np.float32)})
    path = tmp_path / "c/eqxckpt.json"
    manifest = manifest_doc(path.read_text())
    for value, outcome in (
        ("sha256:" + "0" * 64, None),  # another algorithm: cannot be checked, not an error
        ("xxh3-128:" + "A" * 32, "not xxh3-128: and 32 lowercase hex digits"),
        ("xxh3-128:123", "not xxh3-128"),
        (17, "not xxh3-128"),
    ):
        manifest["leaves"][0]["digest"] = value
        path.write_bytes(crafted_manifest(manifest))
        if outcome is None:
            assert eqxckpt.open(tmp_path / "c").leaf("w").digest is None  # type: ignore[attr-defined]
            assert eqxckpt.verify(tmp_path / "c").ok
        else:
            with pytest.raises(eqxckpt.ManifestError, match=outcome):
                eqxckpt.open(tmp_path / "c")
    # A manifest from before digests: loads and verifies.
    del manifest["leaves"][0]["digest"]
    path.write_bytes(crafted_manifest(manifest))
    assert eqxckpt.load(tmp_path / "c")["w"].tolist() == [1.0, 1.0, 1.0] and eqxckpt.verify(tmp_path / "c").ok


def test_a_large_tree_is_hashed_in_batches_on_threads_each_save(tmp_path, monkeypatch):
    """Batches of leaves are hashed on several threads, to the digests the specification
    gives; every save hashes what it holds (a jax.Array on CPU may share memory with a
    numpy array that changed since, so nothing is remembered between saves)."""
    import eqxckpt._write._jobs as jobs_module

    monkeypatch.setattr(jobs_module, "DIGEST_BATCH_BYTES", 1 << 20)
    hashed = []
    real = jobs_module.digest
    monkeypatch.setattr(jobs_module, "digest", lambda fields, data: (hashed.append(fields), real(fields, data))[1])
    tree = {f"w{i}": jnp.full(300_000, i, jnp.float32) for i in range(6)}  # 1.2 MB each: 6 batches
    tree["small"] = [np.full(3, i, np.int8) for i in range(PACK_MIN_LEAVES)]
    for step in range(2):
        eqxckpt.save(tmp_path / str(step), tree)
    assert len(hashed) == 2 * (6 + PACK_MIN_LEAVES)
    leaves = {leaf["path"]: leaf for leaf in manifest_doc((tmp_path / "1/eqxckpt.json").read_text())["leaves"]}
    for i in range(6):
        assert leaves[f"w{i}"]["digest"] == by_the_spec(["array", "float32", [300_000]], np.asarray(tree[f"w{i}"]))
    assert leaves["small/3"]["digest"] == by_the_spec(["array", "int8", [3]], np.full(3, 3, np.int8))


def by_the_spec_for_blocks(fields: list, blocks: list[np.ndarray]) -> str:
    """docs/format.md#digests for a part's leaf: each block's hash, then the hashes in order."""
    head = json.dumps(fields, separators=(",", ":")).encode() + b"\0"
    hashes = b"".join(
        xxhash.xxh3_128(np.ascontiguousarray(b).astype(b.dtype.newbyteorder("<")).tobytes()).digest() for b in blocks
    )
    return "xxh3-128:" + xxhash.xxh3_128(head + hashes).hexdigest()


@st.composite
def grids(draw):
    """An array and a regular grid of blocks over it (a sharding's), as ((start, stop), ...) keys."""
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
    cuts = [sorted(set(draw(st.lists(st.integers(1, n - 1), max_size=2))) if n > 1 else []) for n in shape]
    edges = [list(zip([0, *c], [*c, n])) for c, n in zip(cuts, shape)]
    blocks = [()]
    for dim in edges:
        blocks = [(*b, e) for b in blocks for e in dim]
    data = draw(hnp.arrays(draw(DTYPES), shape))
    return data, blocks


@settings(max_examples=80, deadline=None)
@given(grid=grids(), band=st.sampled_from([1, 7, 64, 8 << 20]))
def test_a_leaf_held_as_tiling_blocks_digests_as_the_whole_and_a_parts_by_block(grid, band):
    """A sharded leaf held whole by one process (its shards tile it) digests as the whole
    leaf, however its bands are cut; a part's blocks, each hashed on its own, as the spec
    says; blocks that overlap, leave a gap or cross bands do not tile."""
    import eqxckpt._digest as digests
    from eqxckpt._digest import Tiled

    data, blocks = grid
    fields = ["array", data.dtype.name, list(data.shape)]
    pieces = [(b, data[tuple(slice(*d) for d in b)]) for b in blocks]
    before, digests.TILED_BAND_BYTES = digests.TILED_BAND_BYTES, band
    try:
        assert Tiled.tiles(data.shape, blocks)
        assert digest(fields, Tiled(data.shape, pieces[::-1])) == by_the_spec(fields, data)
    finally:
        digests.TILED_BAND_BYTES = before
    assert digest(fields, [p for _, p in pieces]) == by_the_spec_for_blocks(fields, [p for _, p in pieces])
    if len(blocks) > 1:
        assert not Tiled.tiles(data.shape, blocks[1:])  # a gap
        assert not Tiled.tiles(data.shape, [*blocks, blocks[0]])  # one twice
    whole = tuple((0, n) for n in data.shape)
    assert not Tiled.tiles(data.shape, [whole, whole[:1] + ((0, 0),) * (data.ndim - 1)])


def test_uneven_bands_do_not_tile():
    from eqxckpt._digest import Tiled

    # Rows 0-4 whole on the left, two blocks of two rows on the right: C order crosses them.
    assert not Tiled.tiles((4, 4), [((0, 4), (0, 2)), ((0, 2), (2, 4)), ((2, 4), (2, 4))])
    assert not Tiled.tiles((4, 4), [((0, 2), (0, 4)), ((1, 4), (0, 4))])  # overlapping bands
    assert Tiled.tiles((4, 4), [((0, 2), (0, 4)), ((2, 4), (0, 2)), ((2, 4), (2, 4))])


SHARDED_SAVE = r"""
import json, pathlib, shutil, sys
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import eqxckpt
from eqxckpt._chunks import CHUNK_BYTES
import eqxckpt._chunks

eqxckpt._chunks.CHUNK_BYTES = 4096  # several chunks per shard
root = pathlib.Path(sys.argv[1])
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
specs = {"rows": P(("a", "b")), "cols": P(None, ("a", "b")), "grid": P("a", "b"), "half": P("a")}
values = {k: np.arange(64 * 32, dtype=np.float32).reshape(64, 32) + 10_000 * i for i, k in enumerate(specs)}
tree = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in values.items()}
eqxckpt.save(root / "c", tree)
leaves = {l.path: l.to_json() for l in eqxckpt.open(root / "c").stored.manifest.leaves}
from eqxckpt._digest import digest
for k, v in values.items():  # every leaf one process holds whole has the whole leaf's digest
    assert leaves[k]["digest"] == digest(["array", "float32", [64, 32]], v), k
assert eqxckpt.verify(root / "c").ok
# Two chunk files of the same size swapped between leaves: each passes its CRC-32C.
a, b = root / "c/rows/c/0/0", root / "c/grid/c/0/0"
a_bytes, b_bytes = a.read_bytes(), b.read_bytes()
a.write_bytes(b_bytes); b.write_bytes(a_bytes)
assert sorted(p for p, _ in eqxckpt.verify(root / "c").problems) == ["grid", "rows"]
for like in ({k: np.zeros((64, 32), np.float32) for k in specs},  # read whole
             {"rows": jax.ShapeDtypeStruct((64, 32), np.float32, sharding=NamedSharding(mesh, P("a")))}):  # placed by rows
    try:
        eqxckpt.load(root / "c", like, strict=False)
    except eqxckpt.CorruptCheckpointError as e:
        assert "not the bytes saved" in str(e), e
    else:
        raise AssertionError("a swapped chunk was loaded")
print("ok")
"""


@pytest.mark.multiprocess
def test_a_leaf_sharded_over_one_processs_devices_is_digested_and_checked(tmp_path):
    """4 CPU devices in one process: leaves sharded by rows, columns, a grid, half the
    devices each get the whole leaf's digest (the fifth outside attack: none was written,
    so chunks swapped between leaves loaded and verified silently)."""
    from conftest import on_devices

    assert on_devices(4, ["-c", SHARDED_SAVE, str(tmp_path)]).strip().endswith("ok")
