"""Key-level operations on an object store's kvstore (`eqxckpt._storage._kvstore`), on
TensorStore's memory store: the same ranged reads and listings as S3 and Cloud Storage."""

import pytest
import tensorstore as ts
from hypothesis import given, settings, strategies as st

from eqxckpt._storage._kvstore import SizeError, list_keys, read_bounded, read_exact, read_parts


@given(size=st.integers(0, 300), asked=st.integers(0, 300))
@settings(max_examples=150, deadline=None)
def test_bounded_reads_return_exactly_the_value_or_refuse_it(size, asked):
    """`read_exact` returns a value of exactly ``asked`` bytes and refuses any other, saying
    its size (or that it is larger); `read_bounded` returns a value of at most ``asked``
    bytes whole and more than that cut to ``asked + 1`` bytes (memory store: the same
    ranged reads as S3 and Cloud Storage)."""
    store = ts.KvStore.open({"driver": "memory"}).result()
    value = bytes(range(256)) * 2
    store.write("k", value[:size]).result()
    if size == asked:
        assert read_exact(store, "k", asked).result().value == value[:size]
    else:
        with pytest.raises(SizeError) as refused:
            read_exact(store, "k", asked).result()
        assert refused.value.size == (size if size < asked else None)
    assert bytes(read_bounded(store, "k", asked).value) == value[: min(size, asked + 1)]
    assert read_exact(store, "absent", asked).result().state == "missing"
    assert read_bounded(store, "absent", asked).state == "missing"


def test_listing_a_prefix_lists_exactly_the_keys_that_start_with_it():
    store = ts.KvStore.open({"driver": "memory"}).result()
    names = ["a", "a.", "a/", "a/b", "a/c/d", "a0", "a/\u00ff", "b", "%holds/x", "%holds0"]
    for name in names:
        store.write(name, b"").result()
    assert list_keys(store) == sorted(names)
    for prefix in ("a/", "a", "%holds/", "a/c/", "z"):
        assert list_keys(store, prefix) == sorted(n for n in names if n.startswith(prefix)), prefix


@given(size=st.integers(0, 300), asked=st.integers(0, 300), part=st.integers(1, 64))
@settings(max_examples=150, deadline=None)
def test_reads_in_parts_reassemble_exactly_the_value_or_refuse_it(size, asked, part):
    """`read_parts` returns ranges of at most ``part`` bytes that join into exactly the value
    when it holds ``asked`` bytes, and refuses any other size as `read_exact` does."""
    store = ts.KvStore.open({"driver": "memory"}).result()
    value = bytes(range(256)) * 2
    store.write("k", value[:size]).result()
    if size == asked:
        results = read_parts(store, "k", asked, part).result()
        assert all(len(r.value) <= part for r in results) and b"".join(r.value for r in results) == value[:size]
        assert len(results) == max(1, -(-asked // part))
    else:
        with pytest.raises(SizeError) as refused:
            read_parts(store, "k", asked, part).result()
        assert refused.value.size == (size if size < asked else None)
    assert [r.state for r in read_parts(store, "absent", asked, part).result()] == ["missing"] * max(
        1, -(-asked // part)
    )
