import json
import math
import pathlib
import re
import struct

import numpy as np
import pytest
from conftest import assert_trees_equal, crafted_manifest, manifest_doc
from hypothesis import HealthCheck, given, settings, strategies as st

import eqxckpt
from eqxckpt._digest import ALGORITHM
from eqxckpt._errors import ManifestError
from eqxckpt._leaf import ArrayLeaf, ScalarLeaf
from eqxckpt._manifest import Manifest, parse_manifest
from eqxckpt._paths import PACKED_LOCATION
from eqxckpt._scalars import scalar_from_json, scalar_to_json

BEFORE = pathlib.Path(__file__).parent / "fixtures" / "written_before_25"

GOOD = {
    "path": "model/w",
    "keys": [["attr", "model"], ["attr", "w"]],
    "kind": "array",
    "shape": [2, 3],
    "dtype": "float32",
    "location": "model/w",
    "array_type": "jax",
}


def doc(*leaves, version=5, **extra):
    """A manifest of these records: a leaf table (version 5), or a record per leaf."""
    document = {"format": "eqxckpt", "version": version, "metadata": {}, "leaves": list(leaves), **extra}
    return crafted_manifest(document)


def test_round_trip():
    records = (
        ArrayLeaf("a/0", (("dict", "a"), ("seq", 0)), (2,), "bfloat16", array_type="numpy"),
        ScalarLeaf("s", (("dict", "s"),), type_name="float", json_value="nan"),
    )
    parsed = parse_manifest(Manifest(records, {"step": 3}).to_bytes())
    assert parsed.leaves == records and parsed.metadata == {"step": 3}


@given(st.text("0123456789abcdef", min_size=32, max_size=32), st.booleans())
def test_the_arrays_prefix_round_trips(hex_digits, named):
    arrays = f"%arrays.{hex_digits}" if named else ""
    records = (ArrayLeaf("w", (("dict", "w"),), (2,), "float32", array_type="numpy"),)
    raw = Manifest(records, {}, arrays=arrays).to_bytes()
    assert json.loads(raw)["version"] == 5
    assert parse_manifest(raw).arrays == arrays


@pytest.mark.parametrize(
    "version, arrays",
    [
        (3, None),
        (4, None),
        (2, "%arrays." + "0" * 32),
        (3, "%arrays." + "0" * 31),
        (3, "%arrays." + "A" * 32),
        (3, "../x"),
        (5, "%arrays." + "0" * 31),
        (5, "../x"),
    ],
)
def test_the_arrays_prefix_comes_with_version_3_and_its_exact_form(version, arrays):
    """Versions 3 and 4 name where the arrays are; an older reader refuses them rather than look beside the manifest."""
    extra = {} if arrays is None else {"arrays": arrays}
    with pytest.raises(ManifestError, match="versions 3 and 4 name where its arrays are"):
        parse_manifest(doc(GOOD, version=version, **extra))


def test_a_leaf_in_a_sibling_checkpoint_round_trips():
    """Leaves an incremental save refers to round-trip, only in a manifest with its own arrays."""
    own, theirs = "%arrays." + "1" * 32, "../7/%arrays." + "2" * 32
    leaves = (
        ArrayLeaf("w", (("dict", "w"),), (2, 3), "float32", "numpy", arrays=theirs),
        ArrayLeaf("v", (("dict", "v"),), (4,), "int8", "numpy"),
    )
    manifest = Manifest(leaves, {}, arrays=own)
    assert manifest.references() == [theirs]
    parsed = parse_manifest(manifest.to_bytes())
    assert parsed.leaves == leaves and parsed.arrays == own and parsed.references() == [theirs]
    with pytest.raises(ManifestError, match="in version 5 only a manifest with 'arrays' has them"):
        parse_manifest(Manifest(leaves, {}).to_bytes())
    # Packed leaves share one packed array: all in the same prefix, or none named.
    packed = [
        ArrayLeaf(name, (("dict", name),), (2,), "float32", "numpy", offset=64 * i, arrays=ref)
        for i, (name, ref) in enumerate([("a", theirs), ("b", None)])
    ]
    with pytest.raises(ManifestError, match="packed leaves in different arrays"):
        parse_manifest(Manifest(tuple(packed), {}, arrays=own).to_bytes())


@given(
    unix=st.floats(0, 1e10, allow_nan=False),
    shares=st.integers(0, 2**31 - 1),
    generations=st.lists(st.binary(min_size=1, max_size=40).map(bytes.hex), min_size=1, max_size=20),
)
def test_what_a_save_saw_of_a_shared_leaf_round_trips(unix, shares, generations):
    """A referring leaf's `seen` (when its objects were checked whole and their generations
    then) round-trips exactly; it is no part of the leaf's digest."""
    from eqxckpt._leaf import Seen

    seen = Seen(unix, shares, tuple(generations))
    leaf = ArrayLeaf("w", (("dict", "w"),), (2, 3), "float32", "numpy", arrays="../7/%arrays." + "2" * 32, seen=seen)
    parsed = parse_manifest(Manifest((leaf,), {}, arrays="%arrays." + "1" * 32).to_bytes())
    assert parsed.leaves == (leaf,) and parsed.leaves[0].seen == seen
    assert leaf.digest_fields() == ArrayLeaf("w", (("dict", "w"),), (2, 3), "float32", "numpy").digest_fields()


SEEN = {"unix": 1.7e9, "shares": 2, "generations": ["00ab", "0cd0"]}


@pytest.mark.parametrize(
    "seen,extra,match",
    [
        (SEEN, {"offset": 0, "location": PACKED_LOCATION}, "only an array of its own records"),
        ({**SEEN, "extra": 1}, {}, "exactly 'unix', 'shares' and 'generations'"),
        ([1, 2], {}, "exactly 'unix'"),
        ({**SEEN, "unix": "yesterday"}, {}, "is not a time"),
        ({**SEEN, "unix": float("inf")}, {}, "is not a time"),
        ({**SEEN, "unix": True}, {}, "is not a time"),
        ({**SEEN, "shares": -1}, {}, "non-negative integer"),
        ({**SEEN, "shares": 1.5}, {}, "non-negative integer"),
        ({**SEEN, "generations": []}, {}, "a list of 1 to"),
        ({**SEEN, "generations": "00ab"}, {}, "a list of 1 to"),
        ({**SEEN, "generations": ["0g"]}, {}, "is not lowercase hex of 1 to 128 bytes"),
        ({**SEEN, "generations": ["abc"]}, {}, "is not lowercase hex of 1 to 128 bytes"),
        ({**SEEN, "generations": ["AB"]}, {}, "is not lowercase hex of 1 to 128 bytes"),
        ({**SEEN, "generations": [""]}, {}, "is not lowercase hex of 1 to 128 bytes"),
        ({**SEEN, "generations": ["ab" * 129]}, {}, "is not lowercase hex of 1 to 128 bytes"),
        ({**SEEN, "generations": [7]}, {}, "is not lowercase hex of 1 to 128 bytes"),
        ({**SEEN, "generations": ["00"] * ((1 << 17) + 1)}, {}, "a list of 1 to"),
    ],
)
def test_a_malformed_seen_is_refused_naming_the_leaf(seen, extra, match):

    leaf = ArrayLeaf("w", (("dict", "w"),), (2,), "float32", "numpy", arrays="../7/%arrays." + "2" * 32)
    document = manifest_doc(Manifest((leaf,), {}, arrays="%arrays." + "1" * 32).to_bytes())
    document["leaves"][0].update({"seen": seen, **extra})
    document["leaves"][0] = {k: v for k, v in document["leaves"][0].items() if v is not None}
    with pytest.raises(ManifestError, match=f"Leaf 'w'.*{match}"):
        parse_manifest(crafted_manifest(document))


@pytest.mark.parametrize(
    "change,match",
    [
        ({"path": "../x", "location": "../x"}, "unsafe"),
        ({"location": "other"}, "location"),
        ({"shape": [-1, 3]}, "negative"),
        ({"shape": [2**40, 2**40]}, "absurd"),
        ({"dtype": "object"}, "dtype"),
        ({"kind": "pickle"}, "kind"),
        ({"keys": [["attr", "model"], ["attr", "v"]]}, "spell"),
        ({"keys": [["attr", "model"]]}, "one"),
        ({"array_type": "torch"}, "array_type"),
    ],
)
@pytest.mark.parametrize("version", [1, 5])
def test_bad_leaves_are_refused(change, match, version):
    with pytest.raises(ManifestError, match=match):
        parse_manifest(doc({**GOOD, **change}, version=version))


def test_document_level_errors():
    with pytest.raises(ManifestError, match="not valid JSON"):
        parse_manifest(b'{"format": ')
    with pytest.raises(ManifestError, match="not hold an eqxckpt manifest"):
        parse_manifest(b"[]")
    for version in (1, 5):
        with pytest.raises(ManifestError, match="twice"):
            parse_manifest(doc(GOOD, GOOD, version=version))
    with pytest.raises(ManifestError, match="integer format version"):
        parse_manifest(json.dumps({"format": "eqxckpt", "version": "1"}).encode())
    with pytest.raises(ManifestError):
        parse_manifest(b"[" * 100000)


@given(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.complex_numbers(), st.text()))
def test_scalars_round_trip(value):
    kind, encoded = scalar_to_json(value)
    back = scalar_from_json(kind, json.loads(json.dumps(encoded, allow_nan=False)))
    assert type(back) is type(value)
    assert repr(back) == repr(value)


def nan_with(sign: int, payload: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", sign << 63 | 0x7FF << 52 | payload))[0]


def parts(v: float | complex) -> list[float]:
    return [v.real, v.imag] if isinstance(v, complex) else [v]


FLOATS = st.one_of(st.floats(), st.builds(nan_with, st.integers(0, 1), st.integers(1, 2**52 - 1)))


@given(st.one_of(FLOATS, st.builds(complex, FLOATS, FLOATS)))
def test_scalar_leaves_keep_every_bit(value):
    """A NaN's sign and payload, which its JSON value ("nan") loses, are kept in ``bits``:
    a manifest gives back the float bit for bit."""
    [leaf] = parse_manifest(Manifest((ScalarLeaf.of("s", (("dict", "s"),), value),), {}).to_bytes()).leaves
    back = leaf.value()
    assert type(back) is type(value)
    assert [struct.pack("<d", x) for x in parts(back)] == [struct.pack("<d", x) for x in parts(value)]
    assert ("bits" in leaf.to_json()) == any(
        math.isnan(x) and struct.pack("<d", x) != struct.pack("<d", math.nan) for x in parts(value)
    )


@pytest.mark.parametrize(
    "type_name, value, bits",
    [
        ("float", 1.0, "7ff0000000000001"),  # bits of a value that is no NaN
        ("float", "nan", "7ff8000000000000"),  # float("nan") itself: never written
        ("float", "nan", "3ff0000000000000"),  # not a NaN
        ("float", "nan", "7FF0000000000001"),  # not lowercase
        ("float", "nan", ["fff8000000000000", None]),
        ("int", 1, "7ff0000000000001"),
        ("complex", ["nan", 1.0], "fff8000000000000"),
        ("complex", ["nan", 1.0], [None, None]),
        ("complex", ["nan", 1.0], [None, "fff8000000000000"]),
    ],
)
def test_bits_that_do_not_fit_the_value_are_refused(type_name, value, bits):
    leaf = {"path": "s", "keys": [["dict", "s"]], "kind": "scalar", "type": type_name, "value": value, "bits": bits}
    with pytest.raises(ManifestError, match=r"Leaf 's': its bits .* damaged or crafted"):
        parse_manifest(doc(leaf))


# --- the manifest's checksum ----------------------------------------------------------------


def flipped(raw: bytes, bit: int) -> bytes:
    at = (bit // 8) % len(raw)
    return raw[:at] + bytes([raw[at] ^ (1 << bit % 8)]) + raw[at + 1 :]


MANIFESTS = st.builds(
    lambda ints, floats, sizes, arrays: Manifest(
        (
            *(ScalarLeaf.of(f"i{k}", (("dict", f"i{k}"),), v) for k, v in enumerate(ints)),
            *(ScalarLeaf.of(f"f{k}", (("dict", f"f{k}"),), v) for k, v in enumerate(floats)),
            *(
                ArrayLeaf(
                    f"p{k}",
                    (("dict", f"p{k}"),),
                    (n,),
                    "float32",
                    "numpy",
                    offset=64 * k,
                    digest=f"{ALGORITHM}:" + "ab" * 16,
                )
                for k, n in enumerate(sizes)
            ),
            ArrayLeaf("w", (("dict", "w"),), (3, 4), "bfloat16", "jax"),
        ),
        {"step": len(ints)},
        arrays=f"%arrays.{arrays}" if arrays else "",
    ),
    st.lists(st.integers(-(2**40), 2**40), max_size=3),
    st.lists(st.floats(allow_nan=False), max_size=2),
    st.lists(st.integers(1, 16), max_size=3),
    st.one_of(st.none(), st.text("0123456789abcdef", min_size=32, max_size=32)),
)


@given(MANIFESTS, st.integers(0, 2**24))
def test_every_flipped_bit_of_a_manifest_is_caught(manifest, bit):
    """A manifest's CRC-32C covers every byte (the name of the field included: a manifest
    whose ``crc32c`` lost a bit does not pass for one written before there was one)."""
    raw = manifest.to_bytes()
    assert raw.startswith(b'{"crc32c": "') and parse_manifest(raw) == manifest
    with pytest.raises(ManifestError):
        parse_manifest(flipped(raw, bit % (8 * len(raw))), "ckpt")


def test_a_changed_value_is_refused_naming_the_checkpoint(tmp_path):
    """A scalar leaf's ``"value": 1`` become 3 (one bit) loads as 3 and verifies as ok
    without a checksum; with one, load and verify both say the manifest is damaged."""
    eqxckpt.save(tmp_path / "c", {"n": 1, "w": np.ones(3, np.float32)})
    manifest = tmp_path / "c" / "eqxckpt.json"
    raw = manifest.read_bytes()
    assert raw.count(b'"value":1') == 1
    manifest.write_bytes(raw.replace(b'"value":1', b'"value":3'))
    with pytest.raises(eqxckpt.ManifestError, match=r"c is damaged \(checksum mismatch\).*earlier checkpoint"):
        eqxckpt.load(tmp_path / "c", {"n": 0, "w": np.zeros(3, np.float32)})
    report = eqxckpt.verify(tmp_path / "c")
    assert not report.ok and [name for name, _ in report.problems] == ["eqxckpt.json"]
    assert "checksum mismatch" in report.problems[0][1]


def test_a_saved_checkpoint_with_a_flipped_manifest_bit_never_loads(tmp_path):
    """Scalars, packed leaves and arrays: every single-bit flip of the manifest is refused
    by load and reported by verify (never other values, never ok)."""
    tree = {
        "n": 1,
        "lr": 0.5,
        "small": [np.full(3, i, np.float32) for i in range(40)],  # packed
        "w": np.arange(12, dtype=np.int16).reshape(3, 4),
    }
    eqxckpt.save(tmp_path / "c", tree)
    manifest = tmp_path / "c" / "eqxckpt.json"
    raw = manifest.read_bytes()
    assert re.search(rb'"offsets": \[[^\]]*[0-9]', raw) and b'"value":1' in raw
    assert_trees_equal(eqxckpt.load(tmp_path / "c", tree), tree)

    @settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.integers(0, 8 * len(raw) - 1))
    def flip(bit):
        manifest.write_bytes(flipped(raw, bit))
        with pytest.raises(eqxckpt.CheckpointError):
            eqxckpt.load(tmp_path / "c", tree)
        assert not eqxckpt.verify(tmp_path / "c").ok

    flip()
    manifest.write_bytes(raw)
    assert eqxckpt.verify(tmp_path / "c").ok


def test_a_manifest_written_before_checksums_still_loads():
    """Manifests without ``crc32c`` (written before it) are read, as they were; one that
    begins with anything else than its checksum or its format is refused."""
    raw = (BEFORE / "eqxckpt.json").read_bytes()
    assert b"crc32c" not in raw and raw.startswith(b'{\n "format"')
    assert len(parse_manifest(raw).leaves) > 10 and eqxckpt.verify(BEFORE).ok
    renamed = Manifest((), {}).to_bytes().replace(b'"crc32c"', b'"crc32b"')  # one bit
    with pytest.raises(ManifestError, match="it begins with 'crc32b'"):
        parse_manifest(renamed)


def test_key_entries_checked_once_are_never_confused_with_equal_values_of_other_types():
    """Valid key entries are remembered (`_plain_segment`); True == 1 and 1.0 == 1 in Python,
    so a remembered ["seq", 1] must not pass ["seq", true] or ["seq", 1.0]."""
    from eqxckpt._manifest import parse_keys as _keys

    assert _keys([["seq", 1]], "1") == (("seq", 1),)
    assert _keys([["dict", 1]], "1") == (("dict", 1),)
    assert _keys([["dict", "a"], ["attr", "b"]], "a/b") == (("dict", "a"), ("attr", "b"))
    for entry in (["seq", True], ["seq", 1.0], ["dict", True], ["attr", 1], ["seq", -1], ["seq", "1"], ["nope", "a"]):
        with pytest.raises(eqxckpt.ManifestError, match="key entry"):
            _keys([entry], "1" if entry[0] != "nope" else "a")
    with pytest.raises(eqxckpt.ManifestError, match="do not spell its path"):
        _keys([["dict", "a"]], "b")


def test_a_leaf_changed_after_its_line_was_encoded_is_written_as_changed(tmp_path):
    """Manifest lines are encoded once per leaf (a save encodes them while it writes);
    a leaf changed afterwards (`with_storage`: an offset, a digest) must never keep the
    old line."""
    from eqxckpt._leaf import ArrayLeaf, with_storage
    from eqxckpt._manifest import Manifest, parse_manifest

    leaf = ArrayLeaf("w", (("dict", "w"),), (2,), "float32", "numpy")
    first = Manifest((leaf,), {})
    digest = "xxh3-128:" + "ab" * 16
    changed = Manifest((with_storage(leaf, digest=digest),), {})
    assert parse_manifest(changed.to_bytes()).leaves[0].digest == digest
    assert parse_manifest(first.to_bytes()).leaves[0].digest is None


@pytest.mark.parametrize(
    "blocks,match",
    [
        ("x", "blocks must be a list"),
        ([], "blocks must be a list"),
        ([[[0, 1]]], "not a non-empty block of shape"),  # one dimension of two
        ([[[0, 1], [0, True]]], "blocks must be a list"),
        ([[[1, 1], [0, 3]]], "not a non-empty block"),
        ([[[0, 2], [0, 4]]], "not a non-empty block"),  # past the edge
        ([[[0, 2], [0, 3]]], "cover all"),  # the whole array: stored whole, never as a block
        ([[[0, 1], [0, 3]], [[0, 1], [0, 3]]], "repeat"),
        ([[[0, 2], [0, 2]], [[1, 2], [2, 3]]], "not the cells of one grid"),  # overlapping rows
        ([[[0, 1], [0, 3]]] * 4097, "at most 4096"),
    ],
)
def test_bad_blocks_of_a_part_are_refused(blocks, match):
    with pytest.raises(ManifestError, match=match):
        parse_manifest(doc({**GOOD, "blocks": blocks}))


def test_a_part_leaf_round_trips_and_holds_only_its_blocks():
    leaf = parse_manifest(doc({**GOOD, "shape": [4, 3], "blocks": [[[2, 4], [0, 3]]]})).leaves[0]
    assert isinstance(leaf, ArrayLeaf) and leaf.blocks == (((2, 4), (0, 3)),) and leaf.nbytes == 2 * 3 * 4
    assert parse_manifest(Manifest((leaf,), {}).to_bytes()).leaves[0] == leaf
    with pytest.raises(ManifestError, match="packed leaf"):
        parse_manifest(doc({**GOOD, "location": "%packed", "offset": 0, "blocks": [[[0, 1], [0, 3]]]}))
    like = np.zeros((4, 3), np.float32)  # no sharding: all of it, which the part does not hold
    assert "holds only blocks [2:4, 0:3]" in (leaf.mismatch(like, cast=False) or "")
