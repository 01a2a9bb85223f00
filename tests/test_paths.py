import re

import jax.tree_util as jtu
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import eqxckpt
from eqxckpt._errors import ManifestError, PathError
from eqxckpt._paths import (
    MANIFEST_NAME,
    MAX_SEGMENT,
    decode_segment,
    encode_segment,
    key_entry,
    key_entry_record,
    keypath_to_path,
    parse_reference,
    record_segment,
    reference,
    validate_path,
)
from eqxckpt._tree import flatten

SAFE = re.compile(r"^[A-Za-z0-9_.\-%~]+$")
keys = st.one_of(
    st.text(max_size=40),
    st.text(alphabet="./ %~\\\x00\n", max_size=6),
    st.sampled_from(["", ".", "..", "...", MANIFEST_NAME, "zarr.json", "c", "a/b", "%", "%25", "~"]),
    st.text(min_size=100, max_size=400),
)


@given(keys)
@settings(max_examples=500)
def test_segment_is_safe(key):
    segment = encode_segment(key)
    assert SAFE.fullmatch(segment)
    assert segment not in (".", "..", MANIFEST_NAME)
    assert len(segment) <= MAX_SEGMENT
    validate_path(segment)  # what we write, we accept back


@given(keys)
@settings(max_examples=500)
def test_segment_round_trips(key):
    segment = encode_segment(key)
    if "~" not in segment:  # not shortened
        assert decode_segment(segment) == key


@given(keys, keys)
@settings(max_examples=500)
def test_segment_is_injective(a, b):
    if a != b:
        assert encode_segment(a) != encode_segment(b)


def test_readable_identifiers_stay_as_they_are():
    for name in ["weight", "layers", "Dense_0", "conv1.bias", "0", "mu"]:
        assert encode_segment(name) == name


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.builds(jtu.DictKey, st.one_of(st.text(max_size=8), st.integers(-3, 3), st.booleans(), st.floats(0, 2))),
            st.builds(jtu.GetAttrKey, st.text(max_size=8)),
            st.builds(jtu.SequenceKey, st.integers(0, 5)),
            st.builds(jtu.FlattenedIndexKey, st.integers(0, 5)),
        ),
        max_size=30,
    )
)
def test_a_key_entry_asked_again_gives_its_own_record(entries):
    # Entries are remembered by type and exact key: DictKey(True), DictKey(1) and DictKey(1.0)
    # are equal as dict keys but not as records.
    for entry in entries:
        record = tuple(key_entry_record(entry))
        assert key_entry(entry) == (record, record_segment(record))
        assert type(key_entry(entry)[0][1]) is type(record[1])


def test_keypath_strings():
    tree = {"model": {"layers": [{"w": 1}]}, "ints": {3: 2}, "a/b": 3}
    paths = [keypath_to_path(kp) for kp, _ in jtu.tree_flatten_with_path(tree)[0]]
    assert sorted(paths) == ["a%2Fb", "ints/3", "model/layers/0/w"]


@given(
    st.one_of(
        st.dictionaries(keys, st.integers(), max_size=8), st.dictionaries(st.integers(-5, 5), st.integers(), max_size=8)
    )
)
@settings(max_examples=200)
def test_flatten_either_unique_or_collision_error(tree):
    segments = {}
    collides = False
    for k in tree:
        seg = (str(k) if isinstance(k, int) else encode_segment(k)).casefold()
        collides |= seg in segments
        segments[seg] = k
    if collides:
        with pytest.raises(PathError):
            flatten(tree)
    else:
        paths = [p for p, _, _ in flatten(tree)[0]]
        assert len(set(paths)) == len(paths)


def test_case_only_collision_is_an_error():
    with pytest.raises(PathError, match="case"):
        flatten({"W": 0, "w": 1})


@given(st.dictionaries(keys, st.integers(0, 1000), min_size=1, max_size=6))
@settings(max_examples=40, deadline=None)
def test_arbitrary_keys_round_trip_through_disk(tmp_path_factory, tree):
    try:
        flatten(tree)
    except PathError:
        return  # case-only collisions are refused, tested above
    path = tmp_path_factory.mktemp("ckpt") / "c"
    tree = {k: np.full((2,), v, np.int32) for k, v in tree.items()}
    eqxckpt.save(path, tree)
    assert eqxckpt.load(path).keys() == tree.keys()
    restored = eqxckpt.load(path, tree)
    for k in tree:
        np.testing.assert_array_equal(restored[k], tree[k])
    # and every stored directory stays inside the checkpoint
    for p in path.rglob("*"):
        assert path in p.resolve().parents


@pytest.mark.parametrize(
    "bad",
    ["", "..", "a/../b", "/etc/passwd", "a//b", "a\\b", "a\x00b", "a/./b", "a b", MANIFEST_NAME, "x/\n", 3, None],
)
def test_validate_path_rejects_hostile(bad):
    with pytest.raises(ManifestError):
        validate_path(bad)


@pytest.mark.parametrize("key", ["EQXCKPT.JSON", "Eqxckpt.Json", "EQXCKPT.LEASE.JSON"])
def test_keys_that_fold_to_eqxckpt_files_are_refused(tmp_path, key):
    """On a case-insensitive store such a key would clash with the manifest (or the lease)."""
    with pytest.raises(eqxckpt.PathError, match="case-insensitive"):
        eqxckpt.save(tmp_path / "c", {key: np.ones(2)})
    assert not (tmp_path / "c").exists()
    eqxckpt.save(tmp_path / "ok", {"eqxckpt.json": np.ones(2)})  # the exact name is escaped, as before
    assert eqxckpt.open(tmp_path / "ok").paths == ["eqxckpt%2Ejson"]


NAMES = st.text(alphabet="abc09_.-/%~ Ωx\x00", max_size=12)


@given(
    st.one_of(NAMES, st.builds(lambda a, b: f"../{a}/%arrays.{b}", NAMES, st.text("0123456789abcdefA", max_size=33)))
)
def test_a_leaf_reference_parses_only_in_its_exact_form(text):
    """Any string is either a sibling's own prefix, which round-trips, or a ManifestError."""
    try:
        entry, arrays = parse_reference(text, "w")
    except ManifestError:
        return
    assert reference(entry, arrays) == text
    assert "/" not in entry and entry not in (".", "..") and re.fullmatch(r"%arrays\.[0-9a-f]{32}", arrays)


def test_a_leaf_reference_accepts_a_step_and_refuses_what_leads_elsewhere():
    prefix = "%arrays." + "0" * 32
    assert parse_reference(f"../12/{prefix}", "w") == ("12", prefix)
    for bad in (
        f"../../{prefix}",
        f"/{prefix}",
        f".././{prefix}",
        f"../../x/{prefix}",
        f"../a/b/{prefix}",
        "../7/%packed",
    ):
        with pytest.raises(ManifestError, match="must be '../<checkpoint beside this one>/"):
            parse_reference(bad, "w")
