"""`verify`: read every byte of a checkpoint and check it against its manifest."""

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from ._checkpoint import Checkpoint, open_checkpoint
from ._chunks import ChunkFileError, ChunkLayout, Region
from ._digest import LeafDigest
from ._errors import CheckpointChangedError, CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, plural
from ._leaf import StoredLeaf, check_bool_bytes
from ._paths import MANIFEST_NAME, PACKED_LOCATION
from ._progress import Progress, advance, reporting
from ._storage import CheckpointPath, resolve
from ._store import PACK_CHUNK_BYTES, read_window
from ._window import Task, run_windowed

# Reads in flight: an eighth of what is verified, at least this and at most the host
# memory budget (`read_window`): a large checkpoint's 64 MiB chunks are checked two or
# more at a time, and verifying holds a small part of it.
SLAB_BYTES = 64 * 1024 * 1024


def _window(nbytes: int) -> int:
    return max(SLAB_BYTES, min(read_window(nbytes), nbytes // 8))


class _Buffers:
    """Buffers handed back once their bytes were checked, for the next reads: a fresh buffer
    costs a page fault per page (on a VM, often a fault in the host too), more than reading
    into it. Holds at most ``limit`` bytes of free buffers."""

    def __init__(self, limit: int):
        self._free: dict[int, list[np.ndarray]] = {}
        self._held, self._limit = 0, limit

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        nbytes = math.prod(shape) * dtype.itemsize
        free = self._free.get(nbytes)
        if free:
            raw = free.pop()
            self._held -= nbytes
        else:
            raw = np.empty(nbytes, np.uint8)
        return raw.view(dtype).reshape(shape)

    def give(self, buffer: np.ndarray) -> None:
        if buffer.nbytes and self._held + buffer.nbytes <= self._limit:
            self._free.setdefault(buffer.nbytes, []).append(buffer.reshape(-1).view(np.uint8))
            self._held += buffer.nbytes


@dataclasses.dataclass
class VerifyReport:
    """What `verify` checked and every problem it found, as ``(path, message)``;
    ``shared_with`` names, for each damaged leaf, the checkpoints beside this one that
    hold the very same files (incremental saves share unchanged leaves), so damaged too.

    ```python
    report = eqxckpt.verify("ckpt")
    print(report.bytes_checked, report.problems)
    ```
    """

    location: str
    leaves: int = 0
    arrays_checked: int = 0
    bytes_checked: int = 0
    problems: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    # Damaged chunks of the packed array, with why: each is named once here, and each
    # leaf with bytes in one has a short line in `problems`.
    damaged_chunks: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    # For each damaged leaf (and packed chunk) whose stored files other checkpoints beside
    # this one hold too (incremental saves share unchanged leaves): their names, in order.
    # The damage is theirs as well: one file, not one per checkpoint.
    shared_with: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    _packed: set[str] = dataclasses.field(default_factory=set, repr=False)  # packed leaves' paths
    _reasons: dict[str, str] = dataclasses.field(default_factory=dict, repr=False)  # problems, briefly

    @property
    def ok(self) -> bool:
        """Whether no problem was found.

        **Returns:** True for an intact checkpoint.

        ```python
        assert eqxckpt.verify("ckpt").ok
        ```
        """
        return not self.problems

    def lines(self) -> list[tuple[str, str, list[str]]]:
        """Each problem as ``(path, what, details)``: one line naming a damaged leaf or packed
        chunk, and the further lines that say more (why a chunk failed, which checkpoints
        share the damaged files). What `__str__` and ``eqxckpt verify`` print.

        **Returns:** a list of ``(path, message, details)``.

        ```python
        for path, what, details in eqxckpt.verify("ckpt").lines():
            print(f"{path}: {what}", *details)
        ```
        """
        out: list[tuple[str, str, list[str]]] = []
        for path, message in self.problems:  # a packed leaf's line points at its chunk's, which says it
            out.append((path, message, [] if path in self._packed else self._sharing(path)))
        for key, why in self.damaged_chunks:
            out.append(
                (
                    key,
                    "a damaged chunk of the packed array (the leaves with bytes in it are above)",
                    [why, *self._sharing(key)],
                )
            )
        return out

    def _sharing(self, path: str) -> list[str]:
        names = self.shared_with.get(path)
        if not names:
            return []
        return [f"the same stored files are in {', '.join(names)} beside it (shared unchanged): damaged there too"]

    def __str__(self) -> str:
        head = (
            f"{self.location}: {plural(self.leaves, 'leaf', 'leaves')}, {plural(self.arrays_checked, 'array')} "
            f"intact, {self.bytes_checked} bytes checked, {plural(len(self.problems), 'problem')}"
        )
        lines = [
            line
            for path, what, details in self.lines()
            for line in [f"  {path}: {what}", *(f"    {detail}" for detail in details)]
        ]
        return "\n".join([head] + lines)


def verify(path: CheckpointPath, *, progress: Progress = False) -> VerifyReport:
    """Read every chunk of every leaf, checking checksums, shapes and dtypes
    against the manifest, and each leaf's bytes against the digest the manifest
    records for it (which catches chunks swapped between leaves or put back
    from an older save); report each problem with its leaf path.

    Never raises for a damaged checkpoint: the report lists what is wrong, and
    for a damaged leaf whose files other checkpoints in the same directory share
    (hard links or references made by incremental saves), names them
    (``report.shared_with``): one damaged file, not one per checkpoint.
    Raises `CheckpointNotFoundError` when there is no checkpoint at ``path``.

    **Arguments:**

    - `path`: where the checkpoint is (as for `eqxckpt.open`).
    - `progress`: as for `eqxckpt.save` (True: a bar on a terminal). Off by default.

    **Returns:** a `VerifyReport`; ``report.ok`` is True if nothing is wrong.

    ```python
    report = eqxckpt.verify("checkpoints/step_100")
    assert report.ok, report
    ```
    """
    location = resolve(path)
    report = VerifyReport(str(location))
    try:
        checkpoint = open_checkpoint(path)
    except CheckpointNotFoundError:
        raise  # nothing there (or a directory of checkpoints): not a damaged checkpoint
    except CheckpointError as e:
        report.problems.append((MANIFEST_NAME, str(e)))
        return report
    report.leaves = len(checkpoint)
    stored = [record for record in checkpoint.records().values() if isinstance(record, StoredLeaf)]
    packed = [record for record in stored if record.offset is not None]
    stored = [record for record in stored if record.offset is None]
    try:
        with (
            checkpoint.consistent(),
            reporting(f"verifying {location}", sum(r.nbytes for r in stored + packed), len(stored + packed), progress),
        ):
            _check_own(checkpoint, stored, report)
            if packed:
                _check_packed(checkpoint, packed, report)
            report.problems.extend(checkpoint.stored.unlisted())
            _find_sharers(checkpoint, report)
    except CheckpointChangedError as e:
        # What was checked may belong to another checkpoint: say so, and nothing else.
        report.problems[:] = [(MANIFEST_NAME, str(e))]
    return report


def _find_sharers(checkpoint: Checkpoint, report: VerifyReport) -> None:
    """Name, for each damaged leaf and packed chunk, the checkpoints beside this one that
    hold the same stored files (`Storage.sharers`): asked only where something is damaged."""
    location, manifest = checkpoint.stored.storage, checkpoint.stored.manifest
    damaged = [r for path, _ in report.problems if isinstance(r := checkpoint.stored.records.get(path), StoredLeaf)]
    report._packed.update(r.path for r in damaged if r.offset is not None)
    packed = checkpoint.stored.packed
    in_packed = location.sharers(manifest, packed) if packed and (report._packed or report.damaged_chunks) else []
    for record in damaged:
        if names := in_packed if record.offset is not None else location.sharers(manifest, record):
            report.shared_with[record.path] = names
    if in_packed:
        report.shared_with.update((key, in_packed) for key, _ in report.damaged_chunks)


def damaged_leaves(checkpoint: Checkpoint, records: Sequence[StoredLeaf]) -> dict[str, str]:
    """Of ``records`` (stored leaves of ``checkpoint``), those whose stored bytes fail the
    checks `verify` makes (every chunk's CRC-32C, the leaf's digest, a packed chunk holding
    any of its bytes), with why: what a save checks before it shares them (`_save`).

    Raises `CheckpointChangedError` if ``checkpoint`` was replaced or deleted meanwhile.
    """
    report = VerifyReport(str(checkpoint.location))
    with checkpoint.consistent():
        _check_own(checkpoint, [record for record in records if record.offset is None], report)
        if packed := [record for record in records if record.offset is not None]:
            _check_packed(checkpoint, packed, report)
    chunks = " ".join(why for _, why in report.damaged_chunks)  # what a packed leaf's line points at
    return {
        path: chunks if chunks and record.offset is not None else report._reasons.get(path, message)
        for path, message in report.problems
        if (record := checkpoint.stored.records.get(path)) is not None and isinstance(record, StoredLeaf)
    }


def _count(report: VerifyReport, record: StoredLeaf, problem: CheckpointError | None) -> None:
    """One leaf checked: counted, or its problem listed; progress advances either way."""
    if problem is None:
        report.arrays_checked += 1
        report.bytes_checked += record.nbytes
    else:
        report.problems.append((record.path, str(problem)))
        report._reasons[record.path] = _chunk_reason(problem)
    advance(record.nbytes)


def _check_own(checkpoint: Checkpoint, records: list[StoredLeaf], report: VerifyReport) -> None:
    """Leaves with arrays of their own: every chunk read and its checksum checked, all in
    one window, each leaf's digest computed over slabs of whole rows of chunks in order."""
    problems: dict[str, CheckpointError] = {}
    window = _window(sum(record.nbytes for record in records))
    buffers = _Buffers(window)

    def reads() -> Iterator[Task]:  # buffers made as the window takes each task, let go as it settles
        yield from (task for record in records for task in leaf_reads(record))

    def leaf_reads(record: StoredLeaf) -> Iterator[Task]:
        try:
            record.check_known()  # e.g. a PRNG implementation this JAX knows
            # Read by the layout of its zarr.json once that was checked to be what eqxckpt
            # writes (raw bytes plus a crc32c checksum): every chunk's checksum is checked.
            layout = checkpoint.stored.layout(record)
        except CheckpointError as e:
            _count(report, record, e)
            return
        digest = _digest_of(record)
        slabs = _slabs(layout)
        for n, slab in enumerate(slabs):
            buffer = buffers.take(tuple(s.stop - s.start for s in slab), layout.dtype)

            def slab_read(
                buffer: np.ndarray = buffer,
                digest: LeafDigest | None = digest,
                last: bool = n == len(slabs) - 1,
                record: StoredLeaf = record,
            ) -> None:
                if record.path not in problems and digest is not None:
                    digest.update(buffer)
                buffers.give(buffer)
                if last:
                    problem = problems.pop(record.path, None)
                    if problem is None and digest is not None:
                        try:
                            _check_digest(record, digest)
                        except CheckpointError as e:
                            problem = e
                    _count(report, record, problem)

            yield from _tolerant(
                checkpoint.stored.chunk_reads(record, layout, slab, buffer, slab_read), record, problems
            )

    run_windowed(reads(), window)


def _slabs(layout: ChunkLayout) -> list[Region]:
    """An array's rows of chunks, in order: each holds a run of the array's C-order bytes."""
    if not layout.shape or 0 in layout.shape:
        return [tuple(slice(0, n) for n in layout.shape)]
    rest = tuple(slice(0, n) for n in layout.shape[1:])
    rows = layout.chunk[0]
    return [(slice(start, min(start + rows, layout.shape[0])), *rest) for start in range(0, layout.shape[0], rows)]


def _tolerant(tasks: Iterable[Task], record: StoredLeaf, problems: dict[str, CheckpointError]) -> Iterator[Task]:
    """``tasks`` (one leaf's chunk reads), failing into ``problems`` instead of raising: a
    damaged leaf is reported, and every other leaf still checked. Their last settlement
    still runs (it counts the leaf)."""

    def guarded(work: Callable[[], Any]) -> Callable[[], CheckpointError | None]:
        def run() -> CheckpointError | None:
            try:
                work()
            except CheckpointError as e:
                return e
            return None

        return run

    def settled(then: Callable[[Any], None] | None) -> Callable[[Any], None]:
        def settle(failure: CheckpointError | None) -> None:
            if failure is not None:
                problems.setdefault(record.path, failure)
            if then is not None:
                then(None)

        return settle

    return ((nbytes, guarded(work), settled(then)) for nbytes, work, then in tasks)


def _digest_of(record: StoredLeaf) -> LeafDigest | None:
    """The digest to compute as ``record``'s bytes are read; None if the manifest records none."""
    return None if record.digest is None else LeafDigest(record.digest_fields())


def _chunk_reason(error: CheckpointError) -> str:
    """What is wrong with a chunk file, as the read found it (`ChunkFileError`), without the
    words that name the leaf: a damaged packed chunk's line names the chunk."""
    found = error.__context__
    return f"{found}." if isinstance(found, ChunkFileError) else str(error)


def _check_digest(record: StoredLeaf, digest: LeafDigest) -> None:
    """The bytes read, in order, are the ones the save recorded."""
    if digest.value != record.digest:
        raise CorruptCheckpointError(
            f"its bytes pass their chunks' checksums but are not the bytes saved (digest {digest.value}, the "
            f"manifest records {record.digest}): chunks were swapped or rewritten. Restore it from a copy.",
            leaf_path=record.path,
        )


def _check_packed(checkpoint: Checkpoint, packed: list[StoredLeaf], report: VerifyReport) -> None:
    """Read the packed array slab by slab; a slab that fails is read again chunk by chunk
    (all at once), so that exactly the leaves with bytes in a damaged chunk are reported.
    Bool leaves' bytes are checked in the slabs as they are read."""
    array = checkpoint.stored.packed
    assert array is not None
    length = array.shape[0]
    failures: list[tuple[int, int, str]] = []
    bad_bools: dict[str, CheckpointError] = {}
    digests = {record.path: digest for record in packed if (digest := _digest_of(record)) is not None}
    in_order, first = sorted(packed, key=lambda record: record.offset or 0), 0

    def take(start: int, data: np.ndarray) -> None:
        """The part of each leaf in ``data`` (bytes from ``start``; pieces come in order):
        into its digest, and for bools, checked."""
        nonlocal first
        end = start + data.size
        while first < len(in_order) and (in_order[first].offset or 0) + in_order[first].nbytes <= start:
            first += 1
        for i in range(first, len(in_order)):
            record, offset = in_order[i], in_order[i].offset or 0
            if offset >= end:
                break
            low, high = max(offset, start), min(offset + record.nbytes, end)
            if low >= high:
                continue
            if record.path in digests:
                digests[record.path].update(data[low - start : high - start])
            if record.dtype == "bool" and record.path not in bad_bools:
                try:
                    check_bool_bytes(data[low - start : high - start].view(np.bool_), record.path)
                except CheckpointError as e:
                    bad_bools[record.path] = e

    chunk = PACK_CHUNK_BYTES  # what names a damaged chunk, once the layout is known
    try:
        layout = checkpoint.stored.packed_layout
        chunk = layout.chunk[0]
        window = _window(length)
        buffers = _Buffers(window)

        def reads() -> Iterator[Task]:  # buffers made as the window takes each task, let go as it settles
            for _, part in layout.regions():
                [run] = part
                buffer = buffers.take((run.stop - run.start,), np.dtype(np.uint8))
                found: dict[str, CheckpointError] = {}

                def chunk_read(run: slice = run, buffer: np.ndarray = buffer, found: dict = found) -> None:
                    if (error := found.get(array.path)) is not None:
                        failures.append((run.start, run.stop, _chunk_reason(error)))
                    else:  # a leaf with bytes in a failed chunk is reported as damaged, its digest unchecked
                        take(run.start, buffer)
                    buffers.give(buffer)

                yield from _tolerant(
                    checkpoint.stored.chunk_reads(array, layout, part, buffer, chunk_read), array, found
                )

        run_windowed(reads(), window)
    except CheckpointError as e:
        failures.append((0, length, str(e)))
    for start, _, why in failures:
        report.damaged_chunks.append((f"{PACKED_LOCATION}/c/{start // chunk}", why))
    for record in packed:
        offset = record.offset or 0
        try:
            record.check_known()
            problem = next(
                (
                    CorruptCheckpointError(
                        f"damaged: its bytes [{offset}, {offset + record.nbytes}) are in {PACKED_LOCATION}/c/"
                        f"{start // chunk}, a chunk of the packed array that fails its check (below)",
                        leaf_path=record.path,
                    )
                    for start, end, _ in failures
                    if offset < end and offset + record.nbytes > start
                ),
                bad_bools.get(record.path),
            )
            if problem is None and record.path in digests:
                _check_digest(record, digests[record.path])
        except CheckpointError as e:
            problem = e
        _count(report, record, problem)
