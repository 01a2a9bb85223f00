"""Planning replica-parallel saves (`eqxckpt._write._shares`); the saves themselves run across
real processes in tests/test_distributed.py."""

import json

import numpy as np
import pytest

import eqxckpt
from eqxckpt._chunks import chunk_shape
from eqxckpt._write._shares import REPLICA_PIECE_BYTES, split_shard


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
    from eqxckpt._write._shares import check_copies_agree, copy_digests

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
