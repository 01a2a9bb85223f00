"""Restores of data replicated across JAX processes, read once in all: a target replicated
over mesh axes that span processes is first read into an intermediate sharding that splits
it over those axes (`spread`), so each process reads a disjoint part, then moved to the
target by one jitted identity per batch of leaves, through the devices' collectives (gloo
on CPU, NCCL on GPU) (`read_once`). The processes restoring together agree on the
checkpoint and the targets first, and fail together (`failing_together`).
"""

import contextlib
import hashlib
import itertools
import json
import math
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._errors import ArgumentError, CheckpointChangedError
from .._leaf import StoredLeaf
from .._window import host_memory_budget
from ._place import held_by, slice_key

if TYPE_CHECKING:
    import jax

    from ._source import Source


def spanning_axes(names: Sequence[str], processes: np.ndarray) -> set[str]:
    """The axes of a mesh along which devices belong to different processes, given the
    process of each of its devices (``processes``, shaped as the mesh).

    ```python
    spanning_axes(("a", "b"), np.array([[0, 0], [1, 1]]))  # {'a'}
    ```
    """
    return {
        name for i, name in enumerate(names) if (np.moveaxis(processes, i, 0) != np.moveaxis(processes, i, 0)[:1]).any()
    }


def spread_spec(
    spec: Any, shape: tuple[int, ...], sizes: dict[str, int], spanning: set[str]
) -> "jax.sharding.PartitionSpec | None":
    """`spread`'s partition spec: ``spec`` (of a mesh with axes ``sizes``, in order) also
    split over the axes it leaves unused that are in ``spanning``, along the first
    dimension of ``shape`` that divides; None where there is no such axis or dimension.

    ```python
    spread_spec(P(), (8, 4), {"a": 2, "b": 2}, {"a", "b"})     # P(('a', 'b'),)
    spread_spec(P("a"), (8, 4), {"a": 2, "b": 2}, {"a", "b"})  # P(('b', 'a'),)
    spread_spec(P(None, "a"), (3, 4), {"a": 2, "b": 2}, {"b"})  # P(None, ('b', 'a'))
    spread_spec(P("b"), (8, 4), {"a": 2, "b": 2}, {"b"})       # None: "a" stays in its process
    ```
    """
    import jax

    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    if len(spec) != len(shape) or not all(e is None or isinstance(e, (str, tuple)) for e in spec):
        return None
    entries = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]
    used = {axis for entry in entries for axis in entry}
    axes = tuple(a for a in sizes if a not in used and sizes[a] > 1 and a in spanning)
    if not axes or not math.prod(shape):  # an empty array has nothing to read
        return None
    factor = math.prod(sizes[a] for a in axes)
    for d, n in enumerate(shape):
        if n % (math.prod(sizes[a] for a in entries[d]) * factor) == 0:
            # The axes spanning processes go first (major): each process then holds one run
            # of the dimension, which a save's chunks (split among processes the same way,
            # `split_shard`) lie within.
            entries[d] = (*axes, *entries[d])
            while not entries[-1]:
                entries.pop()
            return jax.sharding.PartitionSpec(*(entry or None for entry in entries))
    return None


def spread(sharding: Any, shape: tuple[int, ...]) -> "jax.sharding.NamedSharding | None":
    """The sharding a restore reads a leaf into before it moves it onto ``sharding``: also
    split, along the first dimension that divides, over the mesh axes ``sharding`` leaves
    unused (replicates over) whose devices belong to different processes (`spread_spec`),
    so each process reads a disjoint part. None where there is nothing to split, or no
    way to: not a `NamedSharding` of a concrete mesh, no such axis, no dimension of
    ``shape`` divisible by the split."""
    import jax

    if not isinstance(sharding, jax.sharding.NamedSharding) or not isinstance(sharding.mesh, jax.sharding.Mesh):
        return None
    mesh = sharding.mesh
    processes = np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)
    spec = spread_spec(sharding.spec, shape, dict(mesh.shape), spanning_axes(mesh.axis_names, processes))
    return None if spec is None else jax.sharding.NamedSharding(mesh, spec, memory_kind=sharding.memory_kind)


def readers_apart(chunk: Sequence[int], sharding: "jax.sharding.Sharding", shape: tuple[int, ...]) -> bool:
    """Whether every chunk (of shape ``chunk``, its leading ``len(shape)`` dimensions) of an
    array of ``shape`` placed by ``sharding`` is held by the devices of one process alone:
    then a restore into ``sharding`` reads each chunk in one process.

    ```python
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))  # two processes of two devices
    readers_apart((4, 4), NamedSharding(mesh, P(("a", "b"))), (8, 4))  # True: a chunk per process
    readers_apart((8, 4), NamedSharding(mesh, P(("a", "b"))), (8, 4))  # False
    ```
    """
    owners: dict[tuple, set[int]] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        owners.setdefault(slice_key(index, shape), set()).add(device.process_index)
    edges = [sorted({key[d] for key in owners}) for d in range(len(shape))]  # each dimension's block runs
    layout = [max(1, c) for c in chunk[: len(shape)]]
    for start in itertools.product(*(range(0, max(1, n), c) for n, c in zip(shape, layout))):
        runs = [
            [run for run in edges[d] if run[0] < min(a + c, shape[d]) and a < run[1]]
            for d, (a, c) in enumerate(zip(start, layout))
        ]
        holders = set().union(*(owners.get(key, set()) for key in itertools.product(*runs)))
        if len(holders) > 1:
            return False
    return True


def _held(sharding: "jax.sharding.Sharding", shape: tuple[int, ...], nbytes: int) -> int:
    """Bytes of the distinct blocks ``sharding`` puts on the devices of the process that
    holds the most: the same in every process (batches must be)."""
    blocks: dict[int, set[tuple]] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        blocks.setdefault(device.process_index, set()).add(slice_key(index, shape))
    most = max(sum(math.prod(b - a for a, b in key) for key in keys) for keys in blocks.values())
    return most * nbytes // max(1, math.prod(shape))


def spans_processes(like: Any) -> bool:
    """Whether ``like`` (a `load`'s) has leaves placed across several JAX processes: then
    every process restores it together (`read_once`, `failing_together`).

    Decided from the placements alone, so that every process decides alike: a leaf held
    by several processes, or leaves held by this process and others held by other
    processes only (a pipeline's stages, each on one host's devices). A process holding
    none of a leaf another process holds whole reads nothing of it."""
    import jax

    if jax.process_count() == 1:
        return False
    me = jax.process_index()
    here = elsewhere = False
    for leaf in jax.tree_util.tree_leaves(like):
        held = held_by(leaf)
        if len(held) > 1:
            return True
        here, elsewhere = here or me in held, elsewhere or bool(held - {me})
    return here and elsewhere


@contextlib.contextmanager
def failing_together(together: bool) -> Iterator[None]:
    """Where ``together``, an exception in the block, raised in this process alone before
    `read_once` (opening the checkpoint, planning), is raised in every other process too,
    at `read_once`'s first phase: they wait for none that will not come, and the next
    restore's phases are the same in every process."""
    try:
        yield
    except Exception as e:
        if together:
            from .._distributed import Phases

            def fail(error: Exception = e) -> str:
                raise error

            Phases("restore").run("plan", fail)  # raises ``e`` here, once the others have it
        raise


def read_once(
    source: "Source", wanted: Sequence[tuple[Any, Any]], together: bool, read_here: Callable[[Sequence[Any]], list[Any]]
) -> list[Any]:
    """``read_here(wanted)``, reading each byte of data replicated across processes once in all:
    such a stored leaf is read into its `spread` sharding, each process its own blocks,
    then moved onto its target with the other leaves of its batch by one jitted identity
    (batches of at most the smallest host memory budget of any process, counting the
    blocks of the process holding the most). Every process must call it with the same
    items, as `load` is called.

    The processes agree at each step (`Phases`) before any data moves: that they opened
    the same checkpoint (`Source.identity`), which leaves they read apart, the budget;
    then each batch is read and checked unchanged (`Source.check_unchanged`) in every
    process before it is moved. A failure in one process is raised in every process, so
    none returns a mix of two checkpoints, and none waits on the others.

    **Arguments:**

    - `source`: what is read (`Source.reads_apart` says which leaves it reads apart).
    - `wanted`: the restore's items, ``(what, target)``: a `StoredLeaf` (which may be
      read apart) or a layout (its ``leaf``, the new leaf; read as it is).
    - `together`: every process restores this (`spans_processes` of `load`'s ``like``):
      they agree on the checkpoint even where no target here spans processes.
    - `read_here`: what reads items in this process (the restore engine's).

    **Returns:** the values, in the order of ``wanted``.
    """
    import jax

    if jax.process_count() == 1 or source.per_process:  # each process reads its own checkpoint
        return read_here(wanted)
    # From `like` alone: the same in every process, so every process takes the same phases.
    # Targets spanning processes make one global array of every process's reads: those
    # processes must agree on the checkpoint and the targets, spread or not.
    shared = [i for i, (_, target) in enumerate(wanted) if len(held_by(target)) > 1]
    if not shared and not together:
        return read_here(wanted)
    leaves = [what if isinstance(what, StoredLeaf) else what.leaf for what, _ in wanted]
    candidates: dict[int, Any] = {}
    for i in shared:
        stored = isinstance(wanted[i][0], StoredLeaf)
        if stored and (middle := spread(wanted[i][1].sharding, leaves[i].shape)) is not None:
            candidates[i] = middle
    from .._distributed import Phases

    phases = Phases("restore")

    def plan() -> str:
        source.chunk_shapes([leaves[i] for i in candidates])  # what `reads_apart` asks: all at once
        apart = [i for i, middle in candidates.items() if source.reads_apart(leaves[i], middle)]
        targets = [[leaves[i].path, describe_target(wanted[i][1])] for i in shared]
        plan = {"source": source.identity(), "apart": apart, "budget": host_memory_budget(), "targets": targets}
        return json.dumps({**plan, "location": str(source.location)})

    plans = [json.loads(found) for found in phases.run("plan", plan)]
    if len({found["source"] for found in plans}) > 1:
        where = "; ".join(f"process {rank}: {found['location']}" for rank, found in enumerate(plans))
        raise CheckpointChangedError(
            f"Restoring into {len(plans)} processes: they opened different checkpoints ({where}): it was "
            "replaced while they opened it, or they were given different paths. Nothing was restored; load "
            "again, the same checkpoint in every process."
        )
    _check_same_targets([found["targets"] for found in plans])
    # A leaf whose stored chunks straddle the spread blocks would be read in part by several processes.
    apart = set.intersection(*(set(found["apart"]) for found in plans))
    spreads = {i: middle for i, middle in candidates.items() if i in apart}
    budget = min(found["budget"] for found in plans)
    values: list[Any] = [None] * len(wanted)
    rest = [i for i in range(len(wanted)) if i not in spreads]

    def read_rest() -> None:
        for i, value in zip(rest, read_here([wanted[i] for i in rest])):
            values[i] = value

    phases.run("read", read_rest)  # a failure here is raised everywhere: no process goes on alone
    if not spreads:
        return values
    batches: list[list[int]] = [[]]
    held = 0
    for i, middle in spreads.items():
        leaf = leaves[i]
        cost = _held(middle, leaf.shape, leaf.nbytes)
        if batches[-1] and held + cost > budget:
            batches.append([])
            held = 0
        batches[-1].append(i)
        held += cost
    for n, batch in enumerate(batches):
        staged: list[Any] = []

        def read(batch: list[int] = batch, staged: list[Any] = staged) -> None:
            staged.extend(read_here([(wanted[i][0], _retarget(wanted[i][1], spreads[i])) for i in batch]))
            # What every process read is the checkpoint they all opened, before any of it moves.
            source.check_unchanged()

        phases.run(f"read {n}", read)  # every process read its part, or every process raises
        moved = jax.jit(_identity, out_shardings=tuple(wanted[i][1].sharding for i in batch))(*staged)
        del staged[:]  # the blocks go as soon as they are moved
        for i, value in zip(batch, moved):
            values[i] = value
    return values


def describe_target(target: Any) -> str:
    """A leaf of `like` placed across processes, as the processes restoring it together
    must all give it: its dtype, shape and sharding (the spec normalised, so that equal
    placements read the same; the order of the mesh's devices as a digest).

    ```python
    describe_target(jax.ShapeDtypeStruct((8, 4), np.float32, sharding=NamedSharding(mesh, P())))
    # 'float32[8,4] NamedSharding(P(), mesh a=2 b=2, devices #5d1e...)'
    ```
    """
    import jax

    sharding, shape = target.sharding, tuple(target.shape)
    if isinstance(sharding, jax.sharding.NamedSharding) and isinstance(sharding.mesh, jax.sharding.Mesh):
        mesh = sharding.mesh
        sizes = dict(mesh.shape)
        spec = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in sharding.spec]
        spec = [tuple(a for a in entry if sizes.get(a, 2) > 1) for entry in spec]  # size-1 axes split nothing
        while spec and not spec[-1]:
            spec.pop()
        axes = " ".join(f"{name}={size}" for name, size in sizes.items())
        order = hashlib.blake2b(np.asarray(mesh.device_ids, np.int64).tobytes(), digest_size=6).hexdigest()
        where = f"NamedSharding(P{tuple(entry or None for entry in spec)}, mesh {axes}, devices #{order}"
    else:
        blocks = sorted((d.id, slice_key(index, shape)) for d, index in sharding.devices_indices_map(shape).items())
        where = f"{type(sharding).__name__}(blocks #{hashlib.blake2b(repr(blocks).encode(), digest_size=6).hexdigest()}"
    kind = "" if sharding.memory_kind in (None, "device") else f", memory {sharding.memory_kind}"
    return f"{target.dtype}[{','.join(map(str, shape))}] {where}{kind})"


def _check_same_targets(asked: list[list[list[str]]]) -> None:
    """Raise `ArgumentError` where the processes restoring together gave different targets."""
    first = asked[0]
    for rank, other in enumerate(asked[1:], 1):
        if other == first:
            continue
        for (path, mine), (theirs, found) in itertools.zip_longest(first, other, fillvalue=("(none)", "(none)")):
            if (path, mine) != (theirs, found):
                raise ArgumentError(
                    f"Restoring into {len(asked)} processes: they passed different `like` trees. Leaf {path!r}: "
                    f"process 0 expects {mine}, process {rank} gave {theirs!r} as {found}. Nothing was "
                    "restored; call load in every process with the same `like` (shapes, dtypes, shardings)."
                )


def _identity(*values: Any) -> tuple[Any, ...]:
    return values


def _retarget(target: Any, sharding: Any) -> Any:
    """``target`` (a leaf of `like`) with ``sharding`` instead of its own."""
    import jax

    return jax.ShapeDtypeStruct(target.shape, target.dtype, sharding=sharding)
