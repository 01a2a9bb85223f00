"""Planning replica-parallel saves and single-read restores (`eqxckpt._replicas`); the
saves and restores themselves run across real processes in tests/test_distributed.py."""

import json

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import eqxckpt
from eqxckpt._chunks import chunk_shape
from eqxckpt._replicas import REPLICA_PIECE_BYTES, spanning_axes, split_shard, spread_spec

SQUARE = {"a": 2, "b": 2}


def test_axes_whose_devices_belong_to_different_processes_span_them():
    by_rows = np.array([[0, 0], [1, 1]])  # a 2x2 mesh, a process a row
    assert spanning_axes(("a", "b"), by_rows) == {"a"}
    assert spanning_axes(("a", "b"), np.arange(4).reshape(2, 2)) == {"a", "b"}  # a device a process
    assert spanning_axes(("a", "b"), np.zeros((2, 2), int)) == set()  # one process


@pytest.mark.parametrize(
    "spec, shape, spanning, split",
    [
        (P(), (8, 4), {"a", "b"}, P(("a", "b"))),  # replicated on every process: split 4 ways
        (P("a"), (8, 4), {"a", "b"}, P(("b", "a"))),  # sharded over "a", replicated over "b": "b" major
        (P("a"), (2, 8), {"a", "b"}, P("a", "b")),  # rows too few: the next dimension
        (P(None, "a"), (3, 4), {"b"}, P(None, ("b", "a"))),
        (P(), (8, 4), {"a"}, P("a")),  # "b" stays within a process: only "a" is split
    ],
)
def test_a_replication_axis_spanning_processes_is_split_along_a_dimension_that_divides(spec, shape, spanning, split):
    assert spread_spec(spec, shape, SQUARE, spanning) == split


@pytest.mark.parametrize(
    "spec, shape, spanning, why",
    [
        (P("a", "b"), (8, 4), {"a", "b"}, "nothing replicated"),
        (P("b"), (8, 4), {"b"}, "replicated only within processes"),
        (P(), (8, 4), set(), "one process"),
        (P(), (3, 5), {"a", "b"}, "no dimension divides by 4"),
        (P(), (), {"a", "b"}, "a scalar"),
        (P(), (0, 4), {"a", "b"}, "empty"),
    ],
)
def test_every_process_reads_for_itself_where_nothing_splits(spec, shape, spanning, why):
    assert spread_spec(spec, shape, SQUARE, spanning) is None, why


def test_a_shard_held_by_several_processes_is_cut_into_that_many_tiles():
    rows = 4 * REPLICA_PIECE_BYTES // 1024  # 4 pieces of 256-float32 rows
    assert split_shard((rows, 256), (rows, 256), 4, 4, 64 << 20) == (rows // 4, 256)
    assert split_shard((rows + 1, 256), (rows + 1, 256), 4, 4, 64 << 20) == (rows // 4 + 1, 256)  # whole: any length
    # Sharded rows (two shards) held by 4 processes each: cut by a divisor, or along the next dimension.
    assert split_shard((2 * rows, 256), (rows, 256), 4, 4, 64 << 20) == (rows // 4, 256)
    assert split_shard((6, 1 << 16), (3, 1 << 16), 4, 4, 64 << 20) == (3, 1 << 14)
    # Small ones stay whole (spread between processes leaf by leaf), and so do those already
    # in as many chunks as holders.
    assert split_shard((16, 8), (16, 8), 4, 4, 64 << 20) == (16, 8)
    assert split_shard((rows, 256), (rows, 256), 4, 1, 64 << 20) == (rows, 256)
    big = (4 * 64 * 1024, 256)  # 256 MiB: 4 chunks of 64 MiB already
    assert split_shard(big, big, 4, 4, 64 << 20) == big


def test_chunks_of_a_split_shard_never_straddle_two_writers():
    shape = (4097, 256)
    tile = split_shard(shape, shape, 4, 4, 64 << 20)
    chunk = chunk_shape(shape, 4, tile, 64 << 20)
    assert tile[0] % chunk[0] == 0


def test_copies_of_a_part_must_agree_between_processes():
    """`copy_digests` / `check_copies_agree`: the digests each process publishes of its
    copies of shared parts; equal copies pass, and any difference names the leaf, the
    part and the first two processes that disagree (the save is refused before its commit).
    A copy of a whole leaf has the leaf's digest, which process 0 takes from its manifest."""
    from eqxckpt._digest import digest
    from eqxckpt._leaf import ArrayLeaf
    from eqxckpt._replicas import check_copies_agree, copy_digests

    data = np.arange(24, dtype=np.float32).reshape(6, 4)
    rows = (slice(0, 3), slice(None))
    w = ArrayLeaf("w", (("dict", "w"),), (6, 4), "float32", "jax")
    b = ArrayLeaf("b", (("dict", "b"),), (6,), "float32", "jax")

    def published(copy: np.ndarray, known: dict | None = None) -> str:
        return copy_digests([(w, rows, copy[:3]), (b, (slice(None),), np.ascontiguousarray(copy[:, 0]))], known or {})

    whole = digest(b.digest_fields(), data[:, 0])
    assert json.loads(published(data))["b"] == {"0:6": whole}  # the leaf's own digest
    assert json.loads(published(data, {"b": "known"}))["b"] == {"0:6": "known"}  # not hashed again
    check_copies_agree([published(data, {"b": whole}), published(data.copy()), "", published(data)])
    changed = data.copy()
    changed[1, 2] += 1
    with pytest.raises(
        eqxckpt.UnsupportedLeafError, match=r"leaf differ .*'w' \(part \[0:3,0:4\]: processes 0 and 2\)"
    ):
        check_copies_agree([published(data), "", published(changed)])
    assert "'b'" not in str(
        pytest.raises(eqxckpt.UnsupportedLeafError, check_copies_agree, [published(data), published(changed)]).value
    )
