"""The leaf table (`_manifest/_table.py`): a manifest's leaves as columns. Every leaf kind
round-trips, each record is what its kind's parser makes of the same record, and every
malformed column is refused naming the leaf or the column."""

import json
import math

import numpy as np
import pytest
from conftest import crafted_manifest, manifest_doc
from hypothesis import HealthCheck, given, settings, strategies as st

import eqxckpt
from eqxckpt._errors import ManifestError
from eqxckpt._leaf import ArrayLeaf, KeyLeaf, OpaqueLeaf, ScalarLeaf, Seen, parse_leaf
from eqxckpt._manifest import LeafTable, Manifest, leaf_cell, parse_keys, parse_manifest, table_of, table_rows
from eqxckpt._paths import PACK_ALIGNMENT, PACKED_LOCATION, record_segment
from eqxckpt._scalars import nan_bits, scalar_to_json

# --- every leaf kind round-trips --------------------------------------------------------

KEY_ENTRIES = st.one_of(
    st.tuples(st.just("attr"), st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)),
    st.tuples(st.just("dict"), st.text(max_size=12)),  # escapes, "", ".", "%", reserved names
    st.tuples(st.just("dict"), st.text(min_size=130, max_size=140)),  # shortened with a hash: keys listed
    st.tuples(st.just("dict"), st.integers(-5, 10**6)),
    st.tuples(st.just("seq"), st.integers(0, 40)),
    st.tuples(st.just("index"), st.integers(0, 40)),
    st.tuples(st.just("dict"), st.text(max_size=8), st.just("repr")),
)
DTYPES = ["float32", "bfloat16", "int8", "uint4", "bool", "complex64", "float8_e4m3fn"]
DIGESTS = st.one_of(st.none(), st.binary(min_size=16, max_size=16).map(lambda b: "xxh3-128:" + b.hex()))
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.complex_numbers(allow_nan=True),
    st.text(max_size=10),
)


@st.composite
def records(draw):
    """Leaves of every kind, each in a subtree of its own (so that any keys make one tree),
    packed ones at aligned offsets that do not overlap, some with fields of their own."""
    count = draw(st.integers(0, 30))
    leaves, end = [], 0
    for i in range(count):
        keys = (("dict", f"l{i}"), *draw(st.lists(KEY_ENTRIES, max_size=3)))
        path = "/".join(record_segment(key) for key in keys)
        kind = draw(st.sampled_from(["array", "packed", "prng_key", "scalar", "opaque", "shared", "part"]))
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        digest = draw(DIGESTS)
        if kind in ("array", "packed", "shared"):
            dtype, array_type = draw(st.sampled_from(DTYPES)), draw(st.sampled_from(["jax", "numpy", "numpy_scalar"]))
            leaf = ArrayLeaf(path, keys, shape, dtype, array_type, digest=digest)
            if kind == "packed":
                leaf = ArrayLeaf(path, keys, shape, dtype, array_type, digest=digest, offset=end)
                end += -(-leaf.nbytes // PACK_ALIGNMENT) * PACK_ALIGNMENT + PACK_ALIGNMENT * draw(st.integers(0, 2))
            elif kind == "shared":  # an array another checkpoint holds, checked when
                leaf = ArrayLeaf(
                    path,
                    keys,
                    shape,
                    dtype,
                    array_type,
                    digest=digest,
                    arrays=f"../{draw(st.integers(0, 9))}/%arrays." + "3" * 32,
                    seen=Seen(draw(st.floats(0, 1e10)), draw(st.integers(0, 99)), ("00ab", "ff")),
                )
        elif kind == "part":
            leaf = ArrayLeaf(path, keys, (4, 3), "float32", "jax", digest=digest, blocks=(((2, 4), (0, 3)),))
        elif kind == "prng_key":
            impl, key_shape = draw(st.sampled_from([("threefry2x32", (2,)), ("rbg", (4,))]))
            offset = None
            if draw(st.booleans()):
                offset, end = end, end + PACK_ALIGNMENT * (1 + math.prod(shape) * math.prod(key_shape) * 4 // 64)
            leaf = KeyLeaf(path, keys, shape, "uint32", impl, key_shape, digest=digest, offset=offset)
        elif kind == "scalar":
            value = draw(SCALARS)
            leaf = ScalarLeaf(path, keys, *scalar_to_json(value), nan_bits(value))
        else:
            leaf = OpaqueLeaf(path, keys, draw(st.sampled_from(["builtins.function", "object"])), draw(st.text()))
        leaves.append(leaf)
    return tuple(leaves)


@settings(max_examples=300, deadline=None)
@given(records(), st.booleans())
def test_every_leaf_kind_round_trips(leaves, own_arrays):
    """What a manifest writes comes back equal, record for record, whatever order its
    records are made in, and each is what its kind's parser makes of its record."""
    shared = any(leaf.__dict__.get("arrays") for leaf in leaves)
    arrays = "%arrays." + "1" * 32 if own_arrays or shared else ""
    raw = Manifest(leaves, {"n": 1}, arrays=arrays, sequences_complete=False).to_bytes()  # (one index each)
    parsed = parse_manifest(raw)
    assert isinstance(parsed.leaves, LeafTable) and len(parsed.leaves) == len(leaves)
    assert [parsed.leaves[i] for i in reversed(range(len(leaves)))] == list(reversed(leaves))  # made one by one
    assert tuple(parsed.leaves) == leaves and parsed.leaves == leaves
    for leaf in parsed.leaves:  # as the kind's own parser reads the record
        assert leaf == parse_leaf(leaf.to_json(), parse_keys)
        assert type(leaf) is type(parse_leaf(leaf.to_json(), parse_keys))
    rows = table_rows(json.loads(raw)["leaves"])
    assert [parse_leaf(row, parse_keys) for row in rows] == list(leaves)


def test_a_tree_saved_and_loaded_keeps_every_kind_and_its_manifest_is_small(tmp_path):
    """A save's manifest is a table: the leaves of a layer share their type, their keys
    are compact where the path spells them, and a small leaf costs about 60 bytes."""
    import jax

    tree = {
        "model": {"layers": [{"w": np.full((4, 3), i, np.float32), "b": np.zeros(3, np.float32)} for i in range(50)]},
        "key": jax.random.key(1),
        "step": 7,
        "lr": float("nan"),
        "act": jax.nn.relu,
        "odd": [{"a/b": np.ones(2, np.int8)}, {3: np.ones(2, np.int8)}],
    }
    eqxckpt.save(tmp_path / "c", tree)
    raw = (tmp_path / "c" / "eqxckpt.json").read_bytes()
    table = json.loads(raw)["leaves"]
    assert table["count"] == 106 and len(table["types"]) == 6
    assert table["keys"].count("ddsd") == 100 and table["keys"].count("d") == 4
    assert set(table["fields"]) == {str(i) for i, p in enumerate(table["paths"]) if p in ("step", "lr")}
    assert len(raw) / 106 < 90
    loaded = eqxckpt.load(tmp_path / "c", tree)
    assert np.array_equal(loaded["model"]["layers"][49]["w"], tree["model"]["layers"][49]["w"])
    assert loaded["step"] == 7 and math.isnan(loaded["lr"]) and loaded["odd"][1][3].dtype == np.int8
    assert eqxckpt.verify(tmp_path / "c").ok


# --- malformed columns are refused -----------------------------------------------------


def saved(tmp_path):
    """A checkpoint with packed leaves, a big one, a key, a scalar and a function."""
    import jax

    tree = {"small": [np.full(3, i, np.float32) for i in range(40)], "big": np.ones((300, 300), np.float32)}
    tree.update(key=jax.random.key(0), step=3, f=print)
    eqxckpt.save(tmp_path / "c", tree)
    return tmp_path / "c", json.loads((tmp_path / "c" / "eqxckpt.json").read_bytes())


def refused(path, doc, match):
    (path / "eqxckpt.json").write_bytes(crafted_manifest(doc))
    with pytest.raises(ManifestError, match=match):
        eqxckpt.open(path)
    assert not eqxckpt.verify(path).ok


def index(doc, path):
    return doc["leaves"]["paths"].index(path)


def packed_index(doc, nth):
    return [i for i, offset in enumerate(doc["leaves"]["offsets"]) if offset is not None][nth]


COLUMN_EDITS = {
    "a column shorter": (lambda t: t["paths"].pop(), "'paths' column must list one entry for each of its"),
    "a column longer": (lambda t: t["shapes"].append([1]), "'shapes' column must list one entry"),
    "a column missing": (lambda t: t.pop("offsets"), "'offsets' column must list"),
    "a count that lies": (lambda t: t.update(count=t["count"] + 1), "column must list one entry for each"),
    "the table a list": (None, "as a table"),
    "a path twice": (lambda t: t["paths"].__setitem__(1, t["paths"][0]), "twice"),
    "a path outside": (lambda t: t["paths"].__setitem__(0, "../x"), "unsafe segment"),
    "a path with a newline": (lambda t: t["paths"].__setitem__(0, "small\n0"), "unsafe segment"),
    "a path of the packed array": (lambda t: t["paths"].__setitem__(0, "%packed"), "which no key's path"),
    "a type index outside": (lambda t: t["type"].__setitem__(0, len(t["types"])), "indices into its 'types'"),
    "a type index not an int": (lambda t: t["type"].__setitem__(0, 0.0), "indices into its 'types'"),
    "a type with another field": (lambda t: t["types"][0].update(value=3), "has fields other than"),
    "a type of an unknown kind": (lambda t: t["types"][0].update(kind="pickle"), "unknown kind"),
    "keys that do not spell the path": (lambda t: t["keys"].__setitem__(0, "dd"), "do not spell its path"),
    "an int key that is not decimal": (lambda t: t["keys"].__setitem__(0, "dn"), "do not spell its path"),
    "keys of another kind": (lambda t: t["keys"].__setitem__(0, "dx"), "do not spell its path"),
    "a negative dimension": (lambda t: t["shapes"].__setitem__(0, [-3]), "negative"),
    "a shape of no list": (lambda t: t["shapes"].__setitem__(0, 3), "shape must be a list"),
    "a bool dimension": (lambda t: t["shapes"].__setitem__(0, [True]), "non-integer"),
    "an absurd shape": (lambda t: t["shapes"].__setitem__(0, [2**30, 2**30]), "absurd"),
    "a scalar with a shape": (None, "no stored array"),
    "an offset unaligned": (None, "multiple of 64"),
    "an offset negative": (None, "multiple of 64"),
    "an offset past any array": (None, "ending within"),
    "offsets that overlap": (None, "overlapping bytes"),
    "digests too few": (lambda t: t.update({"xxh3-128": t["xxh3-128"][:-24]}), "base64 of 16 bytes"),
    "digests not base64": (lambda t: t.update({"xxh3-128": "!" + t["xxh3-128"][1:]}), "base64 of 16 bytes"),
    "fields of no leaf": (lambda t: t["fields"].update({str(t["count"]): {"value": 1}}), "which it does not have"),
    "fields naming a path": (lambda t: t["fields"].update({"0": {"path": "x"}}), "which its columns or its type hold"),
    "fields naming an offset": (lambda t: t["fields"].update({"0": {"offset": 64}}), r"its fields hold \['offset'\]"),
    "a fields key of many digits": (lambda t: t["fields"].update({"1" * 5000: {}}), "which it does not have"),
    "more types than leaves": (lambda t: t["types"].extend([t["types"][0]] * t["count"]), "leaf types for"),
    "a path named as a file of ours": (lambda t: t["paths"].__setitem__(0, "ZARR.JSON"), "own file"),
    "a long last segment spelled compactly": (lambda t: t["paths"].__setitem__(0, "b" * 121), "do not spell"),
    "fields with a padded index": (lambda t: t["fields"].update({"01": {"value": 1}}), "which it does not have"),
    "a scalar without its value": (None, "value"),
}


@pytest.mark.parametrize("case", sorted(COLUMN_EDITS))
def test_every_malformed_column_is_refused(tmp_path, case):
    path, doc = saved(tmp_path)
    table = doc["leaves"]
    edit, match = COLUMN_EDITS[case]
    step = index(doc, "step")
    if case == "the table a list":
        doc["leaves"] = "columns"
    elif case == "a scalar with a shape":
        table["shapes"][step] = [1]
    elif case == "a scalar without its value":
        del table["fields"][str(step)]
    elif case.startswith("an offset") or case == "offsets that overlap":
        first, second = packed_index(doc, 0), packed_index(doc, 1)
        table["offsets"][second] = {
            "an offset unaligned": 65,
            "an offset negative": -64,
            "an offset past any array": 2**53,
            "offsets that overlap": table["offsets"][first],
        }[case]
    else:
        edit(table)
    refused(path, doc, match)


def test_a_record_no_column_can_hold_is_refused_naming_the_leaf(tmp_path):
    """What tests edit (records, via `manifest_doc`) is written back as the writer would
    (`crafted_manifest`); a location the offsets column cannot say is kept in the leaf's
    fields, which the reader refuses: a packed leaf's place is the column's alone (an
    attack moved one onto another's bytes through its fields)."""
    path, _ = saved(tmp_path)
    doc = manifest_doc((path / "eqxckpt.json").read_bytes())
    next(row for row in doc["leaves"] if row["path"] == "small/0")["location"] = "elsewhere"
    refused(path, doc, r"Leaf 'small/0': its fields hold \['location', 'offset'\]")
    path, _ = saved(tmp_path / "again")
    doc = manifest_doc((path / "eqxckpt.json").read_bytes())
    first, second = (row for row in doc["leaves"] if row["path"] in ("small/0", "small/1"))
    second.update(location="%packed", offset=first["offset"])  # onto small/0's bytes
    refused(path, doc, "overlapping bytes")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_any_single_entry_changed_parses_or_is_refused(tmp_path_factory, data):
    """Any entry of any column replaced by any JSON value: a `ManifestError` or records
    that are what each one's parser makes of its record (never anything else)."""
    path, doc = saved(tmp_path_factory.mktemp("t"))
    table = doc["leaves"]
    column = data.draw(st.sampled_from(["paths", "keys", "type", "shapes", "offsets"]))
    i = data.draw(st.integers(0, table["count"] - 1))
    value = data.draw(
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(-(2**65), 2**65),
            st.text(max_size=6),
            st.lists(st.integers(), max_size=3),
        )
    )
    table[column][i] = value
    try:
        parsed = parse_manifest(crafted_manifest(doc))
    except ManifestError:
        return
    for leaf in parsed.leaves:
        assert leaf == parse_leaf(leaf.to_json(), parse_keys)


@pytest.mark.slow  # about 5 s
def test_a_manifest_of_a_million_small_leaves_fits_and_loads():
    """About 60 bytes a small leaf: a million of them stay under the 64 MiB a load reads,
    where a record per leaf (about 260 bytes) could not hold 300,000. (The cells are made
    here as `leaf_cell` makes a packed float32 leaf's: a million records would take most
    of this test's time making objects, not tables.)"""
    from eqxckpt._manifest import MAX_MANIFEST_BYTES, encode_table, with_checksum

    count = 1_000_000
    cell = leaf_cell(ArrayLeaf("b0/p0", (("dict", "b0"), ("dict", "p0")), (16,), "float32", "jax").to_json())
    _, _, type_key, type_fields, *_ = cell
    digest = bytes.fromhex("5a" * 16)
    cells = (
        (f"b{i // 1000}/p{i % 1000}", "dd", type_key, type_fields, [16], 64 * i, digest, None) for i in range(count)
    )
    head = {"format": "eqxckpt", "version": 5, "metadata": {}, "sequences_complete": True}
    raw = with_checksum((json.dumps(head)[:-1] + ', "leaves": ' + encode_table(cells) + "}").encode())
    assert len(raw) <= MAX_MANIFEST_BYTES and len(raw) / count < 64
    parsed = parse_manifest(raw)
    assert len(parsed.leaves) == count and parsed.leaves[count - 1].path == "b999/p999"
    leaf = parsed.leaves[123_456]
    assert (leaf.path, leaf.offset, leaf.shape, leaf.digest) == (
        "b123/p456",
        64 * 123_456,
        (16,),
        "xxh3-128:" + "5a" * 16,
    )
    assert leaf == parse_leaf(leaf.to_json(), parse_keys)


def test_cells_split_any_record_and_table_rows_put_it_back():
    """Any record (what `manifest_doc` gives tests to edit) survives the split into columns."""
    rows = [
        {"path": "a", "keys": [["dict", "a"]], "kind": "scalar", "type": "int", "value": 3},
        {"path": "b", "keys": [["attr", "b"]], "kind": "array", "shape": [2], "dtype": "int8", "location": "b",
         "array_type": "numpy"},
        {"path": "c", "keys": [["dict", "c", "repr"]], "kind": "opaque", "type": "object"},
        {"path": "d", "keys": 5, "kind": "array", "location": "%packed", "offset": 3, "extra": [1]},
        {"path": None, "kind": float("inf")},
    ]  # fmt: skip
    back = table_rows(table_of(map(leaf_cell, rows)))
    assert back[0] == rows[0] and back[2] == rows[2] and back[3] == rows[3]
    assert back[1] == rows[1]  # (no digest: none in its record)
    assert back[4]["path"] is None and back[4]["kind"] == float("inf")
    assert table_of(map(leaf_cell, rows))["keys"][:3] == ["d", "a", [["dict", "c", "repr"]]]
    assert PACKED_LOCATION == "%packed"


# --- what an outside attack found ------------------------------------------------------


def raw_table(table, **head):
    from eqxckpt._manifest import with_checksum

    doc = {"format": "eqxckpt", "version": 5, "metadata": {}, "sequences_complete": True, **head, "leaves": table}
    return with_checksum(json.dumps(doc).encode())


def test_deep_paths_parse_in_memory_of_the_manifests_size():
    """Containers are walked in path order, holding only those above the one at hand: a
    path of 2,000 segments once cost the square of its length (3.3 GiB for 4.7 MiB)."""
    import tracemalloc

    paths = [f"q{k}" + "/a" * 2000 for k in range(100)]
    table = {
        "count": 100,
        "types": [{"kind": "scalar", "type": "none"}],
        "paths": paths,
        "keys": ["d" * 2001] * 100,
        "type": [0] * 100,
        "shapes": [None] * 100,
        "offsets": [None] * 100,
        "xxh3-128": "",
        "fields": {},
    }
    raw = raw_table(table)
    tracemalloc.start()
    try:
        assert len(parse_manifest(raw).leaves) == 100
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * len(raw) + (16 << 20), peak
    deep = "r" + "/0" * 1000
    table.update(count=2, paths=[f"{deep}/0", f"{deep}/x"], keys=["d" + "s" * 1001, "d" + "s" * 1000 + "d"])
    table.update(type=[0, 0], shapes=[None] * 2, offsets=[None] * 2)  # a list to one leaf, a mapping to the other
    with pytest.raises(ManifestError, match=f"inconsistent at '{deep}'"):
        parse_manifest(raw_table(table))


def test_a_packed_key_whose_bytes_no_int64_holds_is_refused():
    """A PRNG key's bytes are its elements times its key data's: 2**31 keys of 2**31 words
    is 2**64 bytes, which wrapped to 0 in int64 and let it share another leaf's bytes."""
    table = {
        "count": 2,
        "types": [
            {"kind": "prng_key", "dtype": "uint32", "impl": "threefry2x32", "key_shape": [2**31]},
            {"kind": "array", "dtype": "float32", "array_type": "numpy"},
        ],
        "paths": ["a", "b"],
        "keys": ["d", "d"],
        "type": [0, 1],
        "shapes": [[2**31], [4]],
        "offsets": [0, 64],
        "xxh3-128": "",
        "fields": {"0": {"digest": None}, "1": {"digest": None}},
    }
    with pytest.raises(ManifestError, match="Leaf 'a': its key data's shape declares an absurd number"):
        parse_manifest(raw_table(table))  # (its data, 2**62 words, is refused as a shape now)
    table["shapes"][0] = [2**31]
    table["types"][0]["key_shape"] = [2**21]  # 2**52 words: a shape, but 2**54 bytes, past any packed array
    with pytest.raises(ManifestError, match="Leaf 'a': its offset 0 .* its bytes ending within"):
        parse_manifest(raw_table(table))


def test_names_of_code_longer_than_a_manifest_keeps_are_cut_at_save(tmp_path):
    """A function's or a class's name is only shown: one over 1000 characters is cut, so
    that the checkpoint loads (it was written, then refused by every load)."""
    namespace: dict = {}
    exec(f"def {'f' * 1500}(x): return x", namespace)  # noqa: S102 - a test's own function
    function = namespace["f" * 1500]
    eqxckpt.save(tmp_path / "c", {"act": function, "w": np.ones(2)})
    leaf = eqxckpt.open(tmp_path / "c").leaf("act")
    assert len(leaf.name) == 1000 and leaf.name.endswith("\u2026") and leaf.name.startswith("__main__.fff") is False
    assert eqxckpt.load(tmp_path / "c", {"act": function, "w": np.zeros(2)})["act"] is function


def test_many_distinct_types_save_and_load(tmp_path):
    """A type per leaf (every function of its own name) is what a table may hold: as many
    types as leaves (there was a cap of 65,536 that saves did not know)."""
    functions = {}
    for i in range(300):
        namespace: dict = {}
        exec(f"def g{i}(x): return x", namespace)  # noqa: S102
        functions[f"g{i}"] = namespace[f"g{i}"]
    eqxckpt.save(tmp_path / "c", functions)
    table = json.loads((tmp_path / "c" / "eqxckpt.json").read_bytes())["leaves"]
    assert len(table["types"]) == 300
    assert eqxckpt.load(tmp_path / "c", functions) == functions


def test_a_float_scalar_no_float_holds_is_a_manifest_error():
    table = {
        "count": 1,
        "types": [{"kind": "scalar", "type": "float"}],
        "paths": ["lr"],
        "keys": ["d"],
        "type": [0],
        "shapes": [None],
        "offsets": [None],
        "xxh3-128": "",
        "fields": {"0": {"value": 10**400}},
    }
    with pytest.raises(ManifestError, match="Expected a float"):
        parse_manifest(raw_table(table))


def test_a_pytree_without_keys_keeps_its_empty_children(tmp_path):
    """A pytree registered without keys numbers its children (``FlattenedIndexKey``), which
    a load rebuilds as a sequence: an empty child is recorded as None there too, as in a
    list (it was left out, and the manifest written then refused by every load)."""
    import jax

    class NoKeys:
        def __init__(self, a, b):
            self.a, self.b = a, b

    jax.tree_util.register_pytree_node(NoKeys, lambda n: ((n.a, n.b), None), lambda _, c: NoKeys(*c))
    tree = {"n": NoKeys(None, np.ones(2, np.float32))}
    eqxckpt.save(tmp_path / "c", tree)
    plain = eqxckpt.load(tmp_path / "c")
    assert plain["n"][0] is None and np.array_equal(plain["n"][1], np.ones(2, np.float32))
    loaded = eqxckpt.load(tmp_path / "c", tree)
    assert loaded["n"].a is None and np.array_equal(loaded["n"].b, np.ones(2, np.float32))
    assert eqxckpt.verify(tmp_path / "c").ok


@pytest.mark.parametrize("path", ["%PACKED", "a/%Packed", "x/" + "b" * 121 + "/c"])
def test_paths_a_key_cannot_spell_are_refused_as_manifest_errors(path):
    """Caught by a second attack: the bulk path check and the one it falls back on agree
    (no AssertionError); a long segment anywhere is found in linear time."""
    table = {
        "count": 1,
        "types": [{"kind": "scalar", "type": "none"}],
        "paths": [path],
        "keys": ["d" * (path.count("/") + 1)],
        "type": [0],
        "shapes": [None],
        "offsets": [None],
        "xxh3-128": "",
        "fields": {},
    }
    with pytest.raises(ManifestError):
        parse_manifest(raw_table(table))


def test_a_key_array_whose_data_has_more_than_64_dimensions_is_refused():
    """A key array's data is its keys' dimensions then each key's: 64 keys' dimensions and
    rbg's one was accepted, then refused by every read (and passed `verify`)."""
    row = {"path": "k", "keys": [["dict", "k"]], "kind": "prng_key", "shape": [1] * 64, "dtype": "uint32"}
    row.update(location="k", impl="rbg", key_shape=[4])
    with pytest.raises(ManifestError, match="more than 64 dimensions"):
        parse_leaf(row, parse_keys)
    with pytest.raises(ManifestError, match="more than 64 dimensions"):
        parse_manifest(raw_table(table_of([leaf_cell(row)])))


@pytest.mark.parametrize("offset", [2**63, 2**63 - 64, 2**53])
def test_a_packed_offset_no_packed_array_reaches_is_refused_in_every_version(offset):
    """A third attack: versions 1-4 bounded an offset only below by 0, and the one overlap
    check (`PackedArray.check_spans`, in int64) then overflowed; every reader now refuses
    an offset at or past `MAX_ELEMENTS`, as a leaf table's does."""
    from eqxckpt._paths import validate_paths

    rows = [
        {"path": p, "keys": [["dict", p]], "kind": "array", "shape": [16], "dtype": "float32", "array_type": "numpy"}
        for p in ("a", "b")
    ]
    rows[0].update(location="%packed", offset=0)
    rows[1].update(location="%packed", offset=offset)
    for version in (2, 5):
        doc = {"format": "eqxckpt", "version": version, "metadata": {}, "sequences_complete": True, "leaves": rows}
        with pytest.raises(ManifestError, match="must be a non-negative multiple of 64"):
            parse_manifest(crafted_manifest(doc))

    class Path(str):
        pass

    validate_paths([Path("model/w")])  # a str's subclass passes as validate_path takes it
