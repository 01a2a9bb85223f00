"""`verify`: read every byte of a checkpoint and check it against its manifest."""

import collections
import dataclasses

import numpy as np
import tensorstore as ts

from ._checkpoint import Checkpoint, open_checkpoint
from ._digest import LeafDigest
from ._errors import CheckpointChangedError, CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, plural
from ._leaf import StoredLeaf, check_bool_bytes
from ._paths import MANIFEST_NAME, PACKED_LOCATION
from ._progress import Progress, advance, reporting
from ._source import reading
from ._storage import CheckpointPath, corrupt, resolve
from ._store import PACK_CHUNK_BYTES

# Large leaves are read in slabs of whole chunks, so verifying needs little memory.
SLAB_BYTES = 64 * 1024 * 1024


@dataclasses.dataclass
class VerifyReport:
    """What `verify` checked and every problem it found, as ``(path, message)``.

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

    @property
    def ok(self) -> bool:
        """Whether no problem was found.

        **Returns:** True for an intact checkpoint.

        ```python
        assert eqxckpt.verify("ckpt").ok
        ```
        """
        return not self.problems

    def __str__(self) -> str:
        head = (
            f"{self.location}: {plural(self.leaves, 'leaf', 'leaves')}, {plural(self.arrays_checked, 'array')} "
            f"intact, {self.bytes_checked} bytes checked, {plural(len(self.problems), 'problem')}"
        )
        lines = [f"  {path}: {message}" for path, message in self.problems + self.damaged_chunks]
        return "\n".join([head] + lines)


def verify(path: CheckpointPath, *, progress: Progress = False) -> VerifyReport:
    """Read every chunk of every leaf, checking checksums, shapes and dtypes
    against the manifest, and each leaf's bytes against the digest the manifest
    records for it (which catches chunks swapped between leaves or put back
    from an older save); report each problem with its leaf path.

    Never raises for a damaged checkpoint: the report lists what is wrong.
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
            report.problems.extend(checkpoint._arrays.unlisted(set(checkpoint._manifest.stored_paths())))
    except CheckpointChangedError as e:
        # What was checked may belong to another checkpoint: say so, and nothing else.
        report.problems[:] = [(MANIFEST_NAME, str(e))]
    return report


def _count(report: VerifyReport, record: StoredLeaf, problem: CheckpointError | None) -> None:
    """One leaf checked: counted, or its problem listed; progress advances either way."""
    if problem is None:
        report.arrays_checked += 1
        report.bytes_checked += record.nbytes
    else:
        report.problems.append((record.path, str(problem)))
    advance(record.nbytes)


def _check_own(checkpoint: Checkpoint, records: list[StoredLeaf], report: VerifyReport) -> None:
    """Leaves with arrays of their own, checked in order but read concurrently within
    SLAB_BYTES: one at a time, a tree of many small leaves waits on each open and read."""
    pending: collections.deque = collections.deque()
    in_flight = 0

    def settle_oldest() -> None:
        nonlocal in_flight
        record, reads = pending.popleft()
        in_flight -= min(record.nbytes, SLAB_BYTES)
        _count(report, record, _settled(record, reads))

    for record in records:
        while pending and in_flight + min(record.nbytes, SLAB_BYTES) > SLAB_BYTES:
            settle_oldest()
        try:
            reads: list[ts.Future] | CheckpointError = _start_leaf(checkpoint, record)
        except CheckpointError as e:
            reads = e
        pending.append((record, reads))
        in_flight += min(record.nbytes, SLAB_BYTES)
    while pending:
        settle_oldest()


def _settled(record: StoredLeaf, reads: list[ts.Future] | CheckpointError) -> CheckpointError | None:
    """What went wrong with a leaf's reads (or before they started), or None."""
    if isinstance(reads, CheckpointError):
        return reads
    try:
        with reading(record):
            digest = _digest_of(record)
            for read in reads:
                data = read.result()
                if digest is not None:
                    digest.update(data)
            if reads and digest is not None:
                _check_digest(record, digest)
    except CheckpointError as e:
        return e
    return None


def _digest_of(record: StoredLeaf) -> LeafDigest | None:
    """The digest to compute as ``record``'s bytes are read; None if the manifest records none."""
    return None if record.digest is None else LeafDigest(record.digest_fields())


def _check_digest(record: StoredLeaf, digest: LeafDigest) -> None:
    """The bytes read, in order, are the ones the save recorded."""
    if digest.value != record.digest:
        raise CorruptCheckpointError(
            f"its bytes pass their chunks' checksums but are not the bytes saved (digest {digest.value}, the "
            f"manifest records {record.digest}): chunks were swapped or rewritten. Restore it from a copy.",
            leaf_path=record.path,
        )


def _start_leaf(checkpoint: Checkpoint, record: StoredLeaf) -> list[ts.Future]:
    """Check a leaf's metadata and start reading it whole; a leaf over `SLAB_BYTES` is
    read here, slab by slab (so verifying needs little memory; in C order, so its digest
    is computed as it goes), and nothing is left to wait on."""
    record.check_known()  # e.g. a PRNG implementation this JAX knows
    with reading(record):
        # Opened from its zarr.json only once that was checked to be what eqxckpt writes
        # (raw bytes plus a crc32c checksum), so every chunk read below checks its checksum.
        store = checkpoint._open_leaf(record)
        shape = store.shape
        if record.nbytes <= SLAB_BYTES or not shape:
            return [store.read()]
        chunk = store.chunk_layout.read_chunk.shape
        rows = chunk[0] if chunk is not None and chunk[0] is not None else shape[0]
        row_bytes = record.nbytes // max(1, shape[0])
        step = max(1, SLAB_BYTES // max(1, row_bytes * rows)) * rows
        digest = _digest_of(record)
        for start in range(0, shape[0], step):
            slab = store[start : min(start + step, shape[0])].read().result()
            if digest is not None:
                digest.update(slab)
        if digest is not None:
            _check_digest(record, digest)
        return []


def _check_packed(checkpoint: Checkpoint, packed: list[StoredLeaf], report: VerifyReport) -> None:
    """Read the packed array slab by slab; a slab that fails is read again chunk by chunk
    (all at once), so that exactly the leaves with bytes in a damaged chunk are reported.
    Bool leaves' bytes are checked in the slabs as they are read."""
    array = checkpoint._packed
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

    try:
        store = checkpoint._packed_store
        for start in range(0, length, SLAB_BYTES):
            end = min(start + SLAB_BYTES, length)
            try:
                slab = store[start:end].read().result()
            except Exception:  # noqa: BLE001 - found again below, chunk by chunk
                chunks = [
                    (c, store[c : min(c + PACK_CHUNK_BYTES, end)].read()) for c in range(start, end, PACK_CHUNK_BYTES)
                ]
                for chunk, read in chunks:
                    if (error := read.exception()) is not None:
                        failures.append((chunk, chunk + PACK_CHUNK_BYTES, str(corrupt(array, error))))
                    else:  # a leaf with bytes in a failed chunk is reported as damaged, its digest unchecked
                        take(chunk, read.result())
                continue
            take(start, slab)
    except CheckpointError as e:
        failures.append((0, length, str(e)))
    for start, _, why in failures:
        report.damaged_chunks.append((f"{PACKED_LOCATION}/c/{start // PACK_CHUNK_BYTES}", why))
    for record in packed:
        offset = record.offset or 0
        try:
            record.check_known()
            problem = next(
                (
                    CorruptCheckpointError(
                        f"damaged: its bytes [{offset}, {offset + record.nbytes}) are in {PACKED_LOCATION}/c/"
                        f"{start // PACK_CHUNK_BYTES}, a chunk of the packed array that fails its check (below)",
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
