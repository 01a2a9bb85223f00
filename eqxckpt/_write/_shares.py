"""Saves of data replicated across JAX processes: the chunks of each part of a global array
that several processes hold are divided among those processes (`WriteShares`), so each
of N writes about 1/N of the replicated bytes; which arrays are global is agreed first
(`global_leaves`), and the holders' copies are compared before the commit
(`copy_digests`, `check_copies_agree`). The format is unchanged: chunk shapes are free in it.
"""

import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._chunks import ChunkLayout, Region, chunk_budget, chunk_shape
from .._digest import digest
from .._errors import MAX_LISTED, UnsupportedLeafError, plural
from .._leaf import StoredLeaf
from .._read._place import block_holders, slice_key

if TYPE_CHECKING:
    import jax

    from .._distributed import Phases

# A part of an array replicated across processes is split among its holders in pieces of
# at least this many bytes: smaller leaves stay one chunk and spread between processes
# whole, leaf by leaf.
REPLICA_PIECE_BYTES = 64 << 10


def split_shard(
    shape: tuple[int, ...], shard: tuple[int, ...], itemsize: int, holders: int, budget: int
) -> tuple[int, ...]:
    """The shape whose tiles a save's chunks must tile, so that a ``shard`` (of an array of
    ``shape``) held by ``holders`` processes splits among them: ``shard`` itself where its
    chunks are already that many or more, or it is too small to be worth splitting; else
    ``shard`` cut along its first dimension that can be cut into that many tiles (a whole
    dimension of the array, any length; a sharded one, a divisor of its length).

    ```python
    split_shard((1024, 256), (1024, 256), 4, 4, 64 << 20)  # (256, 256)
    split_shard((16, 8), (16, 8), 4, 4, 64 << 20)          # (16, 8): 512 bytes, one chunk
    ```
    """
    nbytes = math.prod(shard) * itemsize
    pieces = min(holders, nbytes // REPLICA_PIECE_BYTES)
    if pieces < 2:
        return shard
    chunk = chunk_shape(shape, itemsize, shard, budget)
    if math.prod(-(-s // c) for s, c in zip(shard, chunk)) >= pieces:
        return shard
    for d, (n, s) in enumerate(zip(shape, shard)):
        if s < pieces:
            continue
        if s == n:  # a whole dimension: the last tile may be shorter
            return (*shard[:d], -(-s // pieces), *shard[d + 1 :])
        if s % pieces == 0:  # tiles must not straddle two shards
            return (*shard[:d], s // pieces, *shard[d + 1 :])
    return shard


class WriteShares:
    """Which process writes which chunks of a save's global arrays: each part of an array
    (a distinct shard) is written by the processes holding it, each chunk by one of them,
    the one with the fewest bytes to write so far. Every process makes the same choices:
    from the arrays' shardings alone, leaf by leaf in the tree's order.

    **Arguments:**

    - `processes`: how many processes save together.

    ```python
    shares = WriteShares(jax.process_count())
    tile, mine = shares.plan(record, array)  # the chunks this process writes of one leaf
    ```
    """

    def __init__(self, processes: int):
        self.load = [0] * processes  # bytes each process writes so far

    def plan(
        self, record: StoredLeaf, value: "jax.Array"
    ) -> tuple[tuple[int, ...], list[tuple[Any, list[Region], bool]]]:
        """The shape the leaf's chunks tile (`split_shard`), and what this process writes
        of it: ``(shard, chunk parts)`` for each shard of ``value`` it writes some of.

        **Arguments:**

        - `record`: the leaf's record (its stored shape and dtype).
        - `value`: the leaf, a global array (not fully addressable).

        **Returns:** the shape, and ``[(addressable shard, [chunk region, ...], shared), ...]``,
        ``shared`` where other processes hold that part too (their copies must agree).
        """
        import jax

        me = jax.process_index()
        shape, itemsize = record.data_shape, np.dtype(record.dtype).itemsize
        assert tuple(value.shape) == shape, (value.shape, shape)  # a PRNG key leaf's value is its key data
        holders = block_holders(value.sharding, shape)
        shard = tuple(value.sharding.shard_shape(shape))
        tile = split_shard(shape, shard, itemsize, max(len(on) for on in holders.values()), chunk_budget(record.path))
        layout = ChunkLayout.planned(record, tile)
        own: dict[tuple, list[Region]] = {}
        for key, on in holders.items():
            for _, part in layout.regions(tuple(slice(a, b) for a, b in key)):
                writer = min(on, key=lambda p: (self.load[p], p))
                self.load[writer] += math.prod(s.stop - s.start for s in part) * itemsize
                if writer == me:
                    own.setdefault(key, []).append(part)
        shards = {}
        for s in sorted(value.addressable_shards, key=lambda s: s.replica_id):
            shards.setdefault(slice_key(s.index, shape), s)
        return tile, [(shards[key], parts, len(holders[key]) > 1) for key, parts in own.items()]


def copy_digests(copies: Sequence[tuple[StoredLeaf, Any, np.ndarray]], known: Mapping[str, str]) -> str:
    """What this process publishes of its copies of parts that other processes write
    chunks of too (`WriteShares`): ``copies`` is ``(leaf's record, the part's index, this
    process's copy)`` each; the JSON of each part's digest, for `check_copies_agree`. A
    copy of a whole leaf has the leaf's own digest (`_digest`), taken from ``known``
    (process 0's, hashed for the manifest) where it is there: nothing is hashed twice."""
    found: dict[str, dict[str, str]] = {}
    for record, index, data in copies:
        span = slice_key(index, record.data_shape)
        whole = all(bounds == (0, n) for bounds, n in zip(span, record.data_shape))
        part = ",".join(f"{a}:{b}" for a, b in span)
        if whole:
            value = known.get(record.path) or digest(record.digest_fields(), data)
        else:
            value = digest(["copy", list(data.shape)], data)
        found.setdefault(record.path, {})[part] = value
    return json.dumps(found)


def check_copies_agree(published: Sequence[str]) -> None:
    """Raise `UnsupportedLeafError` if two processes' copies of a part differ (``published``:
    each process's `copy_digests`, in process order): each wrote some of its chunks from
    its own copy, so the checkpoint would hold a mix of them, and the leaf's digest one
    copy's. Called before the commit: nothing is committed."""
    seen: dict[tuple[str, str], tuple[int, str]] = {}
    differ: dict[str, tuple[str, int, int]] = {}
    for rank, text in enumerate(published):
        for path, parts in (json.loads(text) if text else {}).items():
            for part, value in parts.items():
                first = seen.setdefault((path, part), (rank, value))
                if first[1] != value and path not in differ:
                    differ[path] = (part, first[0], rank)
    if differ:
        listed = [
            f"{path!r} (part [{part}]: processes {a} and {b})"
            for path, (part, a, b) in list(differ.items())[:MAX_LISTED]
        ]
        raise UnsupportedLeafError(
            f"The replicas of {plural(len(differ), 'leaf', 'leaves')} differ between processes: "
            f"{', '.join(listed)}{' ...' if len(differ) > MAX_LISTED else ''}. Each process writes some chunks of a "
            "replicated array from its own copy, so the checkpoint would hold a mix of them; nothing was committed. "
            "JAX assumes an array's replicas are equal: make the computation that produced it give the same values "
            "on every process, or save one process's copy as a host-local array."
        )


def global_leaves(
    values: Sequence[Any], phases: "Phases", before: "Callable[[], None] | None" = None
) -> frozenset[int]:
    """Which of ``values`` (a multi-process save's array leaves, in the same order in every
    process) are global arrays, agreed by every process in one phase: those some process
    does not hold whole. A global array held whole by one process looks host-local there
    (fully addressable); only the others know it is not. The rest are host-local, each
    process's own copy (process 0's is saved). ``before``: this process's checks of its
    tree, run in the phase, so that one process's refusal reaches every process."""
    import jax

    partial = [i for i, value in enumerate(values) if isinstance(value, jax.Array) and not value.is_fully_addressable]

    def work() -> str:
        if before is not None:
            before()
        return json.dumps(_runs(partial))

    found = phases.run("placement", work)
    return frozenset(i for runs in found for start, stop in json.loads(runs) for i in range(start, stop))


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Sorted ``indices`` as ``[start, stop)`` runs (a tree's global leaves are mostly consecutive)."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs
