"""`verify`: read every byte of a checkpoint and check it against its manifest."""

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np

from .._arguments import checked_arguments
from .._chunks import PACK_CHUNK_BYTES, ChunkFileError, ChunkLayout
from .._digest import LeafDigest
from .._errors import CheckpointChangedError, CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, plural
from .._leaf import StoredLeaf, check_bool_bytes
from .._paths import MANIFEST_NAME, PACKED_LOCATION
from .._progress import Progress, advance, reporting
from .._storage import CheckpointPath, Storage, resolve
from .._stored import Settle, StoredArrays


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
    # With ``repair=True``: each leaf (or the packed array) mended, with the twin it was
    # mended from; what is still damaged is in ``problems``.
    mended: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    # ...and each it could not mend, with why.
    unmended: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    _packed: set[str] = dataclasses.field(default_factory=set, repr=False)  # damaged packed leaves' paths

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


@checked_arguments
def verify(path: CheckpointPath, *, progress: Progress = "auto", repair: bool = False) -> VerifyReport:
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
    - `progress`: as for `eqxckpt.save` (``"auto"``: a bar on a terminal for a
      large or slow check; True: always on a terminal).
    - `repair`: mend each damaged leaf from a twin beside it: the same leaf (same digest
      and chunk layout) in another checkpoint of the same directory, stored in other
      files, that verifies whole (a `CheckpointManager` keeps two such copies). Its
      damaged files are rewritten in place: on a local disk every checkpoint sharing them
      (hard links) is mended with it; on an object store the objects are written again.
      Nothing is mended from a twin that does not verify; a leaf without one stays damaged.

    **Returns:** a `VerifyReport`; ``report.ok`` is True if nothing is wrong (after
    mending, with ``repair``: ``report.mended`` names what was mended, and from where,
    ``report.unmended`` what was not, and why).

    ```python
    report = eqxckpt.verify("checkpoints/step_100")
    assert report.ok, report
    report = eqxckpt.verify("run/300", repair=True)  # report.mended: [('model/w', 'run/200')]
    ```
    """
    from ._repair import Repair, repair as mend

    location = resolve(path)
    done: Repair | None = None  # what repair did, once it has tried
    while True:  # verify; to repair, mend what it found and, if anything was, verify again
        report = verify_location(location, progress)
        if done is not None or not repair or report.ok:
            break
        done = mend(location, [leaf for leaf, _ in report.problems])
        if not done.mended:
            break
    if done is not None:
        report.mended, report.unmended = done.mended, done.unmended
    return report


def verify_location(location: Storage, progress: Progress = False) -> VerifyReport:
    """`verify` of the checkpoint at ``location`` (any `Storage`: a copy held in memory too)."""
    report = VerifyReport(str(location))
    try:
        stored = StoredArrays.open(location)
    except CheckpointNotFoundError:
        raise  # nothing there (or a directory of checkpoints): not a damaged checkpoint
    except CheckpointError as e:
        report.problems.append((MANIFEST_NAME, str(e)))
        return report
    report.leaves = len(stored.records)  # what a report of a checkpoint changed meanwhile says
    leaves = [leaf for leaf in stored.records.values() if isinstance(leaf, StoredLeaf)]
    try:
        with (
            stored.consistent(),
            reporting(f"verifying {location}", sum(leaf.nbytes for leaf in leaves), len(leaves), progress),
        ):
            check = _StoredCheck(stored, leaves)
            report = _assembled(report.location, stored, check)
    except CheckpointChangedError as e:
        # What was checked may belong to another checkpoint: say so, and nothing else.
        report.problems[:] = [(MANIFEST_NAME, str(e))]
    return report


def _assembled(location: str, stored: StoredArrays, check: "_StoredCheck") -> VerifyReport:
    """The report of the checkpoint at ``location`` once ``check`` is made: its leaves'
    verdicts, the files its manifest does not name, and for each damaged leaf and packed
    chunk, the checkpoints beside this one that hold the same stored files
    (`StoredArrays.sharers`: asked only where something is damaged)."""
    intact = [leaf for leaf, problem in check.verdicts if problem is None]
    damaged = [(leaf, problem) for leaf, problem in check.verdicts if problem is not None]
    # A damaged packed leaf's line points at its chunk's, which names the sharers.
    packed = {leaf.path for leaf, _ in damaged if leaf.offset is not None}
    in_packed: list[str] = []
    if stored.packing is not None and (packed or check.damaged_chunks):
        in_packed = stored.sharers(stored.packing.record)
    shared_with: dict[str, list[str]] = {}
    for leaf, _ in damaged:
        if names := in_packed if leaf.offset is not None else stored.sharers(leaf):
            shared_with[leaf.path] = names
    if in_packed:
        shared_with.update((key, in_packed) for key, _ in check.damaged_chunks)
    return VerifyReport(
        location,
        len(stored.records),
        arrays_checked=len(intact),
        bytes_checked=sum(leaf.nbytes for leaf in intact),
        problems=[(leaf.path, str(problem)) for leaf, problem in damaged] + stored.unlisted(),
        damaged_chunks=check.damaged_chunks,
        shared_with=shared_with,
        _packed=packed,
    )


def damaged_leaves(stored: StoredArrays, records: Sequence[StoredLeaf]) -> dict[str, str]:
    """Of ``records`` (stored leaves of ``stored``), those whose stored bytes fail the
    checks `verify` makes (every chunk's CRC-32C, the leaf's digest, a packed chunk holding
    any of its bytes), with why: what a save checks before it shares them (`_save`).

    Raises `CheckpointChangedError` if the checkpoint was replaced or deleted meanwhile.
    """
    with stored.consistent():
        check = _StoredCheck(stored, records)
    chunks = " ".join(why for _, why in check.damaged_chunks)  # what a packed leaf's line points at
    return {
        leaf.path: chunks if chunks and leaf.offset is not None else _chunk_reason(problem)
        for leaf, problem in check.verdicts
        if problem is not None
    }


class _StoredCheck:
    """The check of ``leaves``' stored bytes, made on construction through `StoredArrays`'s
    public methods: each array (a leaf's own, then the packed array) read a slab of rows of
    chunks at a time, in order, every chunk's checksum checked as it is read; a slab that
    fails damages the leaves with bytes in it, and every other leaf is still checked. Each
    leaf's bytes go to its digest in order (a packed bool leaf's are checked too), and its
    verdict is made once its last bytes are in: ``verdicts``, in that order, progress
    advancing with each; ``damaged_chunks`` names the packed array's failed chunks."""

    def __init__(self, stored: StoredArrays, leaves: Sequence[StoredLeaf]):
        self.stored = stored
        self.verdicts: list[tuple[StoredLeaf, CheckpointError | None]] = []
        self.damaged_chunks: list[tuple[str, str]] = []
        self._digests: dict[str, LeafDigest] = {}
        own = [leaf for leaf in leaves if leaf.offset is None]
        stored.scan((read for leaf in own for read in self._own_reads(leaf)), sum(leaf.nbytes for leaf in own))
        if packed := [leaf for leaf in leaves if leaf.offset is not None]:
            self._check_packed(packed)

    def _verdict(self, leaf: StoredLeaf, problem: CheckpointError | None, value: str | None = None) -> None:
        """One leaf checked: ``problem`` (what its reads found), else its digest's (``value``,
        else the one computed as its bytes arrived); progress advances."""
        digest = self._digests.pop(leaf.path, None)
        if value is None and digest is not None:
            value = digest.value
        try:
            leaf.check_known()  # e.g. a PRNG implementation this JAX knows
            if problem is None and value is not None:
                leaf.check_digest(value)
        except CheckpointError as e:
            problem = e
        self.verdicts.append((leaf, problem))
        advance(leaf.nbytes)

    def _digest(self, leaf: StoredLeaf) -> None:
        """Start the digest of ``leaf``'s bytes, in order; none if the manifest records none."""
        if (digesting := leaf.digesting()) is not None:
            self._digests[leaf.path] = digesting

    def _own_reads(self, leaf: StoredLeaf) -> Iterator[tuple[StoredLeaf, ChunkLayout, Settle]]:
        """The scan of a leaf with an array of its own: the leaf's problem is its first failure."""
        try:
            leaf.check_known()
            # Read by the layout of its zarr.json once that was checked to be what eqxckpt
            # writes (raw bytes plus a crc32c checksum): every chunk's checksum is checked.
            layout = self.stored.layout(leaf)
        except CheckpointError as e:
            self._verdict(leaf, e)
            return
        self._digest(leaf)
        failures: list[CheckpointError] = []

        def settle(block: int, _: int, data: np.ndarray, failure: CheckpointError | None, last: bool) -> None:
            if failure is not None and not failures:
                failures.append(failure)
            elif not failures and leaf.path in self._digests:
                self._digests[leaf.path].update_raw(data, block)
            if last:
                self._verdict(leaf, failures[0] if failures else None)

        yield leaf, layout, settle

    def _check_packed(self, leaves: list[StoredLeaf]) -> None:
        """Read the packed array chunk by chunk (a slab of its rows of chunks is one chunk):
        a failed chunk damages exactly the leaves with bytes in it (`PackedArray.pieces`).
        A leaf whose bytes are all in one slab is digested in one step (most are: a few KiB
        each); one across slabs, as its bytes arrive."""
        packing = self.stored.packing
        assert packing is not None
        failures: list[tuple[int, int, str]] = []
        bad_bools: dict[str, CheckpointError] = {}
        asked = {leaf.path for leaf in leaves if leaf.digest is not None}
        values: dict[str, str] = {}  # each asked leaf's digest, once all its bytes were read
        streaming: dict[str, LeafDigest] = {}

        def settle(_: int, start: int, data: np.ndarray, failure: CheckpointError | None, last: bool) -> None:
            if failure is not None:  # its leaves are damaged, their digests unchecked
                failures.append((start, start + data.size, _chunk_reason(failure)))
                return
            for member, own, there in packing.pieces(start, start + data.size):
                piece = data[there]
                if member.dtype == "bool":
                    try:
                        check_bool_bytes(piece.view(np.bool_), member.path)
                    except CheckpointError as e:
                        bad_bools.setdefault(member.path, e)
                if member.path not in asked:
                    continue
                whole = own.start == 0 and own.stop == member.nbytes
                hashing = LeafDigest(member.digest_fields()) if whole else streaming.get(member.path)
                if hashing is None:
                    hashing = streaming[member.path] = LeafDigest(member.digest_fields())
                hashing.update_raw(piece)
                if whole:
                    values[member.path] = hashing.value
                elif own.stop == member.nbytes:
                    values[member.path] = streaming.pop(member.path).value

        chunk = PACK_CHUNK_BYTES  # what names a damaged chunk, once the layout is known
        try:
            layout = self.stored.packed_layout
            chunk = layout.chunk[0]
            self.stored.scan([(packing.record, layout, settle)], packing.length)
        except CheckpointError as e:
            failures.append((0, packing.length, str(e)))
        damaged: dict[str, CheckpointError] = {}
        for start, end, why in failures:
            key = f"{PACKED_LOCATION}/c/{start // chunk}"
            self.damaged_chunks.append((key, why))
            for member, _, _ in packing.pieces(start, end):
                offset = member.offset or 0
                damaged.setdefault(
                    member.path,
                    CorruptCheckpointError(
                        f"damaged: its bytes [{offset}, {offset + member.nbytes}) are in {key}, a chunk of the "
                        "packed array that fails its check (below)",
                        leaf_path=member.path,
                    ),
                )
        for leaf in leaves:
            value = values.get(leaf.path)
            if value is None and leaf.path in asked:  # not all its bytes were read (then it is
                # damaged) or it has none: its digest is of what was read
                value = streaming.pop(leaf.path, None) or LeafDigest(leaf.digest_fields())
                value = value.value
            self._verdict(leaf, damaged.get(leaf.path, bad_bools.get(leaf.path)), value)


def _chunk_reason(error: CheckpointError) -> str:
    """What is wrong with a chunk file, as the read found it (`ChunkFileError`), without the
    words that name the leaf: a damaged packed chunk's line names the chunk."""
    found = error.__context__
    return f"{found}." if isinstance(found, ChunkFileError) else str(error)
