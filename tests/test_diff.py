"""`eqxckpt.diff` and ``eqxckpt diff``: every kind of difference with its numbers, equal
digests costing no reads, other formats read and compared, large leaves in slabs."""

import itertools
import math
import struct

import jax
import numpy as np
import pytest
import safetensors.numpy
from conftest import counting_storage, run_cli
from hypothesis import given, settings, strategies as st

import eqxckpt
from eqxckpt import _chunks as chunks_module
from eqxckpt._paths import PACKED_LOCATION
from eqxckpt._read._checkpoint import open_checkpoint
from eqxckpt._stored import StoredArrays


@pytest.fixture
def pair(tmp_path):
    rng = np.random.default_rng(0)
    frozen = rng.standard_normal((256, 256)).astype(np.float32)
    a = {
        "frozen": frozen,
        "adapter": np.array([1.0, 2.0, -4.0, 0.0, np.nan], np.float32),
        "gone": np.zeros(2, np.int8),
        "resized": np.zeros(3, np.float32),
        "key": jax.random.key(0),
        "step": 10,
        "name": "run",
    }
    b = {
        **{k: v for k, v in a.items() if k != "gone"},
        "adapter": np.array([1.5, 2.0, -3.0, 1.0, np.nan], np.float32),
        "resized": np.zeros(4, np.float32),
        "key": jax.random.key(1),
        "step": 12,
        "new": np.ones(2, np.bool_),
    }
    eqxckpt.save(tmp_path / "a", a)
    eqxckpt.save(tmp_path / "b", b)
    return tmp_path / "a", tmp_path / "b"


def test_every_kind_of_difference_with_its_numbers(pair):
    result = eqxckpt.diff(*pair)
    assert result.added == ["new"] and result.removed == ["gone"]
    assert result.retyped == [("resized", "float32[3]", "float32[4]")]
    changed = {c.leaf_path: (c.max_abs, c.max_rel) for c in result.changed}
    # adapter: |a - b| = [0.5, 0, 1, 1, (NaN in both)], relative to |b| = [1.5, 2, 3, 1]; 0 -> 1 is 1/1.
    assert changed == {"adapter": (1.0, 1.0), "key": (None, None), "step": (2.0, 2 / 12)}
    assert sorted(result.unchanged) == ["frozen", "name"]
    assert not result.same
    # Only the two leaves whose digests differ were read, on both sides.
    assert result.bytes_read == 2 * (5 * 4 + 2 * 4)


def test_equal_digests_cost_no_reads(pair, monkeypatch):
    read = []
    real = StoredArrays.open_metadata
    monkeypatch.setattr(StoredArrays, "open_metadata", lambda self, r: (read.append(r.path), real(self, r))[1])
    same = eqxckpt.diff(pair[0], pair[0])
    assert same.same and same.bytes_read == 0 and read == []
    eqxckpt.diff(*pair)
    assert sorted(read) == ["adapter", "adapter", "key", "key"]


def test_other_formats_are_read_and_compared(pair, tmp_path):
    """A safetensors file has no digests: both sides are read and compared byte for byte."""
    a = eqxckpt.open(pair[0])
    tensors = {"frozen": a["frozen"].get(), "adapter": a["adapter"].get() * 2}
    safetensors.numpy.save_file(tensors, str(tmp_path / "m.safetensors"))
    result = eqxckpt.diff(tmp_path / "m.safetensors", pair[0])
    assert result.unchanged == ["frozen"] and [c.leaf_path for c in result.changed] == ["adapter"]
    [adapter] = result.changed
    assert adapter.max_abs == 4.0 and adapter.max_rel == 1.0
    assert result.bytes_read == 2 * (256 * 256 * 4 + 5 * 4)
    assert eqxckpt.diff(pair[0], tmp_path / "m.safetensors", at="frozen").same  # at= may select one leaf


def test_large_leaves_are_compared_in_slabs_with_the_same_result(tmp_path, monkeypatch):
    x = np.linspace(-1, 1, 64 * 100, dtype=np.float64).reshape(64, 100)
    y = x.copy()
    y[63, 99] += 0.25
    eqxckpt.save(tmp_path / "x", {"w": x})
    eqxckpt.save(tmp_path / "y", {"w": y})
    whole = eqxckpt.diff(tmp_path / "x", tmp_path / "y").changed
    monkeypatch.setattr("eqxckpt._check._diff.SLAB_BYTES", 1000)
    reads = []
    real = eqxckpt.LazyArray.get
    monkeypatch.setattr(eqxckpt.LazyArray, "get", lambda self: (reads.append(self.shape), real(self))[1])
    slabs = eqxckpt.diff(tmp_path / "x", tmp_path / "y").changed
    assert whole == slabs and whole[0].max_abs == pytest.approx(0.25)
    assert len(reads) == 2 * 64 and set(reads) == {(1, 100)}  # one row (800 bytes) at a time


def test_command_line_lists_the_differences_and_exits_1(pair):
    status, out, err = run_cli("diff", str(pair[0]), str(pair[1]))
    assert status == 1, err
    lines = out.splitlines()
    assert "+ new" in lines and "- gone" in lines and "~ resized: float32[3] -> float32[4]" in lines
    assert "* adapter: max abs 1, max rel 1" in lines and "* key" in lines
    assert lines[-1].startswith("DIFFERENT 2 unchanged, 3 changed, 1 retyped, 1 added, 1 removed")
    status, out, _ = run_cli("diff", str(pair[0]), str(pair[0]))
    assert status == 0 and out.splitlines()[-1].startswith("SAME 7 unchanged") and "(0 B read)" in out


def test_each_packed_chunk_is_read_once_for_all_its_changed_leaves(tmp_path, monkeypatch):
    """600 changed leaves of 1 KiB packed in 64 KiB chunks: each chunk is read once on
    each side, not once per leaf (#37: 6,000 such leaves took 30 s)."""
    monkeypatch.setattr(chunks_module, "PACK_CHUNK_BYTES", 64 * 1024)
    rng = np.random.default_rng(1)
    a = {f"w{i}": rng.standard_normal(256).astype(np.float32) for i in range(600)}
    b = {path: value + np.float32(i % 3) for i, (path, value) in enumerate(a.items())}  # 400 changed
    eqxckpt.save(tmp_path / "a", a)
    eqxckpt.save(tmp_path / "b", b)
    chunks = {f"{PACKED_LOCATION}/c/{i}" for i in range(-(-600 * 1024 // (64 * 1024)))}
    assert {f"{PACKED_LOCATION}/c/{p.name}" for p in (tmp_path / "a" / PACKED_LOCATION / "c").iterdir()} == chunks
    (storage_a, reads_a), (storage_b, reads_b) = counting_storage(tmp_path / "a"), counting_storage(tmp_path / "b")
    result = eqxckpt.diff(open_checkpoint(storage_a), open_checkpoint(storage_b))
    order = eqxckpt.open(tmp_path / "a").paths  # results in a's order, whatever order they were read in
    assert [c.leaf_path for c in result.changed] == [p for p in order if int(p[1:]) % 3]
    assert all(c.max_abs == pytest.approx(i % 3) for i, c in ((int(c.leaf_path[1:]), c) for c in result.changed))
    assert sorted(result.unchanged) == sorted(f"w{i}" for i in range(0, 600, 3))
    assert reads_a == reads_b == dict.fromkeys(chunks, 1)
    # Batches smaller than the chunks give the same answer (a chunk read once per batch it serves).
    monkeypatch.setattr("eqxckpt._check._diff.SLAB_BYTES", 20 * 1024)
    again = eqxckpt.diff(open_checkpoint(storage_a), open_checkpoint(storage_b))
    assert again.changed == result.changed and sorted(again.unchanged) == sorted(result.unchanged)


def test_packed_leaves_on_object_stores_are_compared_in_batches(store):
    a = {f"w{i}": np.full(64, i, np.float32) for i in range(40)}
    b = {**a, "w7": np.full(64, 7.5, np.float32), "w31": np.full(64, -31, np.float32)}
    eqxckpt.save(store.spec("diff/a"), a)
    eqxckpt.save(store.spec("diff/b"), b)
    result = eqxckpt.diff(store.spec("diff/a"), store.spec("diff/b"))
    assert {c.leaf_path: (c.max_abs, c.max_rel) for c in result.changed} == {"w7": (0.5, 0.5 / 7.5), "w31": (62, 2)}
    assert len(result.unchanged) == 38 and result.bytes_read == 2 * 2 * 64 * 4


def test_a_large_leaf_against_another_format_is_compared_whole(tmp_path, monkeypatch):
    """Slabs only when both sides can be sliced: an eqxckpt leaf over SLAB_BYTES against a
    safetensors tensor (read whole) is compared whole, not its first slab against all of it."""
    x = np.linspace(-1, 1, 64 * 100, dtype=np.float32).reshape(64, 100)
    y = x.copy()
    y[40, 7] = 3.0
    eqxckpt.save(tmp_path / "x", {"w": x})
    safetensors.numpy.save_file({"w": y}, str(tmp_path / "y.safetensors"))
    monkeypatch.setattr("eqxckpt._check._diff.SLAB_BYTES", 1000)
    [changed] = eqxckpt.diff(tmp_path / "x", tmp_path / "y.safetensors").changed
    assert changed.leaf_path == "w" and changed.max_abs == pytest.approx(3.0 - x[40, 7])
    assert eqxckpt.diff(tmp_path / "y.safetensors", tmp_path / "y.safetensors").same


def nan_with(sign: int, payload: int) -> float:
    """The float64 NaN of this sign and (non-zero) payload."""
    return struct.unpack("<d", struct.pack("<Q", sign << 63 | 0x7FF << 52 | payload))[0]


def bits(x: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", x))[0]


def outcome(result: eqxckpt.Diff) -> tuple:
    """What `diff` said of the one leaf ``v``: retyped, unchanged, or changed and by how much."""
    if result.retyped:
        return ("retyped",)
    if result.unchanged:
        return ("unchanged",)
    [changed] = result.changed
    return ("changed", repr(changed.max_abs), repr(changed.max_rel))  # repr: NaN equals NaN


def test_scalars_differ_where_their_bits_do(tmp_path):
    """0.0 and -0.0, and NaNs of another sign or payload, are changed scalars as they are
    changed arrays (#37: scalars were compared with ==); the NaNs' bits survive a save."""
    minus_nan = math.inf - math.inf  # -nan on x86; float("nan") everywhere is +nan
    signalling = nan_with(0, 1)
    a = {"zero": 0.0, "nan": math.nan, "odd": signalling, "same": minus_nan, "c": complex(0.0, math.nan), "n": 2}
    b = {"zero": -0.0, "nan": -math.nan, "odd": nan_with(0, 2), "same": minus_nan, "c": complex(-0.0, math.nan), "n": 2}
    eqxckpt.save(tmp_path / "a", a)
    eqxckpt.save(tmp_path / "b", b)
    result = eqxckpt.diff(tmp_path / "a", tmp_path / "b")
    assert sorted(result.unchanged) == ["n", "same"]
    changed = {c.leaf_path: (c.max_abs, c.max_rel) for c in result.changed}
    assert changed == {"zero": (0.0, 0.0), "nan": (0.0, 0.0), "odd": (0.0, 0.0), "c": (0.0, 0.0)}
    loaded = eqxckpt.load(tmp_path / "a")
    assert bits(loaded["same"]) == bits(minus_nan) != bits(math.nan) and bits(loaded["odd"]) == bits(signalling)
    assert bits(eqxckpt.load(tmp_path / "b")["zero"]) == bits(-0.0)
    # Exactly what the same values give as arrays.
    eqxckpt.save(tmp_path / "x", {k: np.asarray(v) for k, v in a.items()})
    eqxckpt.save(tmp_path / "y", {k: np.asarray(v) for k, v in b.items()})
    arrays = eqxckpt.diff(tmp_path / "x", tmp_path / "y")
    assert sorted(arrays.unchanged) == sorted(result.unchanged)
    assert {c.leaf_path: (c.max_abs, c.max_rel) for c in arrays.changed} == changed


NUMBERS = st.one_of(
    st.floats(),
    st.sampled_from([0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan, math.inf - math.inf]),
    st.builds(nan_with, st.integers(0, 1), st.integers(1, 2**52 - 1)),
    st.integers(-(2**63), 2**63 - 1),
    st.booleans(),
)


@st.composite
def number_pairs(draw):
    x = draw(NUMBERS)
    twins = [st.just(x), NUMBERS] + ([st.just(-x), st.just(abs(x))] if isinstance(x, float) else [])
    return x, draw(st.one_of(twins))


def test_property_scalars_and_arrays_of_the_same_values_get_the_same_verdict(tmp_path, request):
    """For any two numbers (floats with every sign of zero and NaN payload, int64s, bools),
    `diff` says of them as Python scalars what it says of them as 0-d arrays: retyped,
    unchanged, or changed by as much."""
    n = itertools.count()

    @settings(max_examples=1000 if request.config.getoption("--slow") else 40, deadline=None)
    @given(number_pairs())
    def check(pair):
        verdicts = []
        for as_value in (lambda v: v, lambda v: np.asarray(v, {bool: np.bool_, int: np.int64}.get(type(v), None))):
            a, b = tmp_path / f"{next(n)}", tmp_path / f"{next(n)}"
            eqxckpt.save(a, {"v": as_value(pair[0])})
            eqxckpt.save(b, {"v": as_value(pair[1])})
            verdicts.append(outcome(eqxckpt.diff(a, b)))
        assert verdicts[0] == verdicts[1]
        same_bits = type(pair[0]) is type(pair[1]) and np.asarray(pair[0]).tobytes() == np.asarray(pair[1]).tobytes()
        assert (verdicts[0] == ("unchanged",)) == same_bits

    check()
