"""Incremental saves: which leaves a save takes unchanged from an earlier checkpoint, and how.

A save with a ``base`` takes a leaf from it when ``base`` holds it as this save would
write it (same path, digest, dtype and shape, in an array of its own, or all the packed
leaves together) and its bytes there pass every check `verify` makes, or passed it
recently and nothing was written to them since (`Seen`: files' stamps on a local disk,
objects' generations on an object store). On a local disk its files are hard-linked into
the new checkpoint; on an object store the new manifest refers to ``base``'s prefix.
Everything else is written afresh.
"""

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Mapping, Sequence
from types import TracebackType
from typing import Generic, Protocol, TypeVar

from .._check._verify import damaged_leaves
from .._chunks import ChunkLayout
from .._errors import ArgumentError, CheckpointChangedError, CheckpointError, plural, warn_at_caller
from .._leaf import Seen, StoredLeaf
from .._manifest import Manifest
from .._paths import PACKED_LOCATION, reference
from .._storage import CheckpointPath, Staging, Storage, expected_files
from .._stored import StoredArrays
from ._pack import PackedArray

# A leaf shared without reading it (its files' stamps on a local disk, its objects'
# generations on an object store, unchanged since they were checked whole) is checked whole
# again after this many such saves, or `FULL_CHECK_INTERVAL_S` after the check (a save's
# ``full_check_interval_s``).
FULL_CHECK_SHARES = 100
FULL_CHECK_INTERVAL_S = 3600.0


def check_full_check_interval(seconds: object) -> None:
    """Refuse (`ArgumentError`) a ``full_check_interval_s`` that is not a number of seconds >= 0."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 <= seconds < float("inf"):
        raise ArgumentError(f"full_check_interval_s must be a number of seconds >= 0, got {seconds!r}.")


class Job(Protocol):
    """What reuse needs of one array a save writes: its record, and the shard shape its
    chunks must tile (None: written whole by one process)."""

    @property
    def record(self) -> StoredLeaf: ...

    @property
    def shard(self) -> tuple[int, ...] | None: ...


J = TypeVar("J", bound=Job)


@dataclasses.dataclass
class Reuse(Generic[J]):
    """What a save takes from its ``base``, and what it writes afresh: each of its jobs is
    in exactly one of ``linked``, ``referred`` and ``written``.

    A context manager: on a local disk, ``base`` is held (retention does not delete it)
    from when its files are checked until the save that links them ends.

    **Arguments:**

    - `base`: the stored arrays of the checkpoint taken from; None where nothing is.
    - `linked`: jobs whose files are hard-linked from ``base`` (local disks), each with
      those files' keys and what is known of them (`Seen`; None where their stamps could
      not be told).
    - `referred`: jobs whose array stays in a sibling's prefix (object stores), each
      with that prefix as the manifest names it, and what is known of its objects
      (`Seen`; None where their generations could not be told).
    - `written`: jobs written afresh (changed, not in ``base``, or damaged there).

    ```python
    with plan_reuse(base, manifest, jobs, location) as reuse:
        staging.link_files(...)  # see `link_into`
    ```
    """

    base: StoredArrays | None
    linked: list[tuple[J, list[str], Seen | None]]
    referred: list[tuple[J, str, Seen | None]]
    written: list[J]
    hold: contextlib.ExitStack = dataclasses.field(default_factory=contextlib.ExitStack)

    def __enter__(self) -> "Reuse[J]":
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Release ``base`` (its hold, where one was taken).

        ```python
        reuse.close()  # the save that linked its files is over
        ```
        """
        self.hold.close()

    def link_into(self, staging: Staging, manifest: Manifest) -> Manifest:
        """Hard-link (or copy where links are refused) the ``linked`` files of ``base`` into
        ``staging``, then check ``base`` is still the checkpoint that was checked.

        **Arguments:**

        - `staging`: the save's staging place, on the same disk as ``base``.
        - `manifest`: the manifest the save commits.

        **Returns:** ``manifest`` with what is known of each linked leaf's files (`Seen`);
        raises `CheckpointChangedError` if ``base`` was replaced or deleted meanwhile (what
        was linked may not be what its manifest describes).

        ```python
        manifest = reuse.link_into(staging, manifest)
        ```
        """
        if not self.linked:
            return manifest
        assert self.base is not None
        staging.link_files(self.base.arrays, [key for _, keys, _ in self.linked for key in keys])
        self.base.check_unchanged()
        return _recording(manifest, {job.record.path: (None, seen) for job, _, seen in self.linked})

    def refer_from(self, staging: Staging, manifest: Manifest) -> tuple[Manifest, list[J]]:
        """Hold the ``referred`` prefixes for ``staging``'s save, as many as can be held.

        **Arguments:**

        - `staging`: the save's staging place, beside ``base`` on an object store.
        - `manifest`: the manifest the save commits.

        **Returns:** ``manifest`` with each leaf whose prefix is held naming it, and the
        ``referred`` jobs whose prefix could not be held (doomed meanwhile): to write.

        ```python
        manifest, also_written = reuse.refer_from(staging, manifest)
        ```
        """
        if not self.referred:
            return manifest, []
        held = staging.refer(sorted({ref for _, ref, _ in self.referred}))
        refs = {job.record.path: (ref, seen) for job, ref, seen in self.referred if ref in held}
        return _recording(manifest, refs), [job for job, ref, _ in self.referred if ref not in held]


def plan_reuse(
    base: CheckpointPath | None,
    manifest: Manifest,
    jobs: Sequence[J],
    location: Storage,
    full_check_interval_s: float = FULL_CHECK_INTERVAL_S,
) -> Reuse[J]:
    """Which of ``jobs`` a save to ``location`` takes unchanged from ``base``, and how.

    A leaf is taken when ``base`` holds it as this save writes it (same path and digest,
    so kind, dtype and shape; each in an array of its own, or all the packed leaves at the
    same offsets) and its bytes there pass every check `verify` makes. A damaged one is
    written afresh, with a warning naming it: one bit flipped in ``base`` is never shared.
    Leaves whose shards several processes write, and leaves without a digest, are written.

    **Arguments:**

    - `base`: the earlier checkpoint (None: nothing is taken). It is taken from only if
      committed: on a local disk when ``location`` is one too (files are linked), beside
      ``location`` on an object store (prefixes are referred to); else nothing is.
    - `manifest`: the save's manifest, with the digests of the leaves it holds whole.
    - `jobs`: the arrays the save would write.
    - `location`: where the save goes.
    - `full_check_interval_s`: a leaf checked whole within this many seconds (and fewer
      than `FULL_CHECK_SHARES` saves ago) whose files' stamps (local disks) or objects'
      generations (object stores) are still those recorded then is shared without reading
      it; 0: every leaf shared is checked whole.

    **Returns:** a `Reuse`; enter it (or ``close()`` it) to release its hold on ``base``.
    A ``base`` replaced or deleted meanwhile gives nothing taken.

    ```python
    with plan_reuse("run/1", manifest, jobs, resolve("run/2")) as reuse:
        [job.record.path for job in reuse.written]  # the leaves that changed
    ```
    """
    stored = _open_base(base, location)
    if stored is None:
        return Reuse(None, [], [], list(jobs))
    with contextlib.ExitStack() as hold:
        reusable: dict[int, tuple[list[str], Seen | None]] = {}
        referable: dict[int, tuple[str, Seen | None]] = {}
        if stored.arrays.local is None:
            try:
                referable = _referable(stored, manifest, jobs, location, full_check_interval_s)
            except CheckpointChangedError:
                pass  # replaced or deleted meanwhile: everything is written
        else:
            try:  # held, not deleted by retention, while its files are checked and linked
                hold.enter_context(stored.held())
                reusable = _reusable(stored, manifest, jobs, full_check_interval_s)
            except CheckpointChangedError:
                pass  # deleted meanwhile: everything is written
        if not reusable:
            hold.close()
        return Reuse(
            stored,
            [(job, *reusable[id(job)]) for job in jobs if id(job) in reusable],
            [(job, *referable[id(job)]) for job in jobs if id(job) in referable],
            [job for job in jobs if id(job) not in reusable and id(job) not in referable],
            hold.pop_all(),
        )


def _open_base(base: CheckpointPath | None, location: Storage) -> StoredArrays | None:
    """The checkpoint a save may take unchanged leaves from: one committed on a local disk,
    into another on a local disk (its files are linked), or one beside it on an object
    store (referred to); None where there is none to take from."""
    if base is None:
        return None
    try:
        stored = StoredArrays.open(base)
    except CheckpointError:  # gone, damaged, not one: nothing is taken from it
        return None
    if location.local is not None:
        return stored if stored.arrays.local is not None else None
    sibling = location.sibling_name(stored.storage) is not None
    return stored if sibling and stored.manifest.arrays else None


def _unchanged(base: StoredArrays, manifest: Manifest, jobs: Sequence[J]) -> Iterator[tuple[J, StoredLeaf]]:
    """The jobs whose leaf ``base`` already holds as this save would write it, with base's
    leaf: same path and digest (so kind, dtype and shape), each in an array of its own."""
    recorded = {r.path: r for r in manifest.leaves if isinstance(r, StoredLeaf)}
    for job in jobs:
        if job.record.path == PACKED_LOCATION:
            new_packing, old_packing = PackedArray.of(manifest.leaves), base.packing
            if new_packing is not None and old_packing is not None and new_packing.same_bytes_as(old_packing):
                yield job, old_packing.record
            continue
        new, old = recorded.get(job.record.path), base.stored_leaf(job.record.path)
        if not (
            new is None  # the packed array: rewritten whole
            or job.shard is not None
            or new.offset is not None
            or new.digest is None
            or old is None
            or old.offset is not None
            or (old.digest, old.digest_fields()) != (new.digest, new.digest_fields())
        ):
            yield job, old


def _reusable(
    base: StoredArrays, manifest: Manifest, jobs: Sequence[J], full_check_interval_s: float
) -> dict[int, tuple[list[str], Seen | None]]:
    """The unchanged leaves of ``base`` (a committed checkpoint on a local disk) whose files
    are plain files exactly as `expected_files` lays the leaf out, and intact (`_checked`),
    by ``id`` of their job, with the files to take and what is known of them (`Seen`)."""
    laid_out: list[tuple[J, StoredLeaf]] = []
    files: dict[int, list[str]] = {}
    for job, old in _unchanged(base, manifest, jobs):
        expected = {
            k: v for k, v in expected_files([(old, ChunkLayout.planned(old))]).items() if k.startswith(f"{old.path}/")
        }
        found = base.leaf_files(old.path)
        if found is not None and found.keys() == expected.keys():
            if all(size < 0 or found[key] == size for key, size in expected.items()):
                laid_out.append((job, old))
                files[id(job)] = sorted(found)
    return {key: (files[key], seen) for key, (_, seen) in _checked(base, laid_out, full_check_interval_s).items()}


def _referable(
    base: StoredArrays, manifest: Manifest, jobs: Sequence[J], location: Storage, full_check_interval_s: float
) -> dict[int, tuple[str, Seen | None]]:
    """The unchanged and intact (`_checked`) leaves of ``base`` (a committed checkpoint
    beside this one on an object store), by ``id`` of their job, with the prefix their
    array is in (base's own, or the one base refers to: references are never chained) and
    what is known of its objects (`Seen`)."""
    entry = location.sibling_name(base.storage)
    assert entry is not None
    own = reference(entry, base.manifest.arrays)
    unchanged = list(_unchanged(base, manifest, jobs))
    checked = _checked(base, unchanged, full_check_interval_s)
    return {key: (old.arrays or own, seen) for key, (old, seen) in checked.items()}


def _checked(
    base: StoredArrays, unchanged: list[tuple[J, StoredLeaf]], full_check_interval_s: float
) -> dict[int, tuple[StoredLeaf, Seen | None]]:
    """Of ``unchanged`` (each job with base's record of its leaf), the intact ones, by ``id``
    of their job, with base's record and what the new checkpoint records of their files
    or objects (`Seen`).

    Intact: their files' stamps (local disks) or objects' generations (object stores) are
    what ``base`` recorded when they were last checked whole, recently enough (`_vouched`:
    not one byte read), or they pass every check `verify` makes now (`_intact`). What such
    a check records is the generation each chunk's reads found (the bytes checked, not a
    HEAD around them: S3's ETag is the same for the same bytes, so damaged, sound, damaged
    again would look unchanged), only where the leaf is stored in the chunks a save plans
    for it."""
    vouched = _vouched(base, unchanged, full_check_interval_s)
    unsure = [(job, old) for job, old in unchanged if id(job) not in vouched]
    # The packed array (small leaves, all together) is checked whole every time: no record
    # holds its files' generations.
    watched = [(job, old) for job, old in unsure if old.path != PACKED_LOCATION]
    metadata = {id(job): [f"{old.path}/zarr.json"] for job, old in watched}
    storages = {id(base.files_of(old)): base.files_of(old) for _, old in watched}
    checked = time.time()
    before = _generations(base, watched, metadata)
    with contextlib.ExitStack() as recording:
        read = {key: recording.enter_context(storage.recording_generations()) for key, storage in storages.items()}
        intact = _intact(base, unsure)
    after = _generations(base, watched, metadata)
    found: dict[int, tuple[StoredLeaf, Seen | None]] = {}
    for job, old in intact:
        seen = None
        if id(job) in metadata and before[id(job)] is not None and before[id(job)] == after[id(job)]:
            seen = _seen_by_check(old, read[id(base.files_of(old))], before[id(job)], checked)
        found[id(job)] = (old, seen)
    for job, old in unchanged:
        if id(job) in vouched:
            found[id(job)] = (old, vouched[id(job)])
    return found


def _seen_by_check(
    old: StoredLeaf, read: dict[str, set[str]], metadata: tuple[str, ...] | None, checked: float
) -> Seen | None:
    """What a check of ``old``'s array records: the one generation each of its planned
    chunks was read at (``read``) and its metadata's (``metadata``, unchanged across the
    check: a load checks it against the manifest every time), in the order of `_objects`;
    None where the stored chunks are not the planned ones or a chunk changed while read."""
    objects = _objects(old)
    chunks = {key: found for key, found in read.items() if key.startswith(f"{old.path}/")}
    if metadata is None or set(chunks) != {key for key in objects if not key.endswith("/zarr.json")}:
        return None
    if any(len(found) != 1 for found in chunks.values()):
        return None
    generations = tuple(metadata[0] if key.endswith("/zarr.json") else next(iter(chunks[key])) for key in objects)
    return Seen(checked, 0, generations) if Seen.recordable(generations) else None


def _objects(old: StoredLeaf) -> list[str]:
    """The keys of the objects of ``old``'s array (its metadata and chunks), sorted."""
    return sorted(key for key in expected_files([(old, ChunkLayout.planned(old))]) if key.startswith(f"{old.path}/"))


def _generations(
    base: StoredArrays, taken: list[tuple[J, StoredLeaf]], objects: dict[int, list[str]]
) -> dict[int, tuple[str, ...] | None]:
    """For each of ``taken`` with ``objects``, the generations its objects have now (None
    where any could not be told), asked of the store all at once."""
    asked = [(job, old) for job, old in taken if id(job) in objects]
    flat = [(id(job), base.files_of(old), key) for job, old in asked for key in objects[id(job)]]
    by_storage: dict[int, list[int]] = {}
    for at, (_, storage, _) in enumerate(flat):
        by_storage.setdefault(id(storage), []).append(at)
    told: list[str | None] = [None] * len(flat)
    for ats in by_storage.values():
        storage = flat[ats[0]][1]
        for at, generation in zip(ats, storage.generations([flat[at][2] for at in ats])):
            told[at] = generation
    found: dict[int, list[str | None]] = {}
    for (job_id, _, _), generation in zip(flat, told):
        found.setdefault(job_id, []).append(generation)
    return {
        job_id: None if any(g is None for g in generations) else tuple(g for g in generations if g is not None)
        for job_id, generations in found.items()
    }


def _vouched(
    base: StoredArrays, unchanged: list[tuple[J, StoredLeaf]], full_check_interval_s: float
) -> dict[int, Seen]:
    """Of ``unchanged``, the leaves whose files or objects were checked whole within
    ``full_check_interval_s`` and fewer than `FULL_CHECK_SHARES` saves ago and have the
    generations recorded then now (stamps on a local disk: `_storage._stamps`): by ``id``
    of their job, with what the new checkpoint records of them (one more save shared them
    unread)."""
    now = time.time()
    recent = [
        (job, old)
        for job, old in unchanged
        if old.seen is not None
        and old.offset is None
        and old.seen.shares + 1 < FULL_CHECK_SHARES
        and 0 <= now - old.seen.unix < full_check_interval_s
    ]
    objects = {id(job): _objects(old) for job, old in recent}
    current = _generations(base, recent, objects)
    return {
        id(job): dataclasses.replace(old.seen, shares=old.seen.shares + 1)
        for job, old in recent
        if old.seen is not None and current.get(id(job)) == old.seen.generations
    }


def _intact(base: StoredArrays, taken: list[tuple[J, StoredLeaf]]) -> list[tuple[J, StoredLeaf]]:
    """Of ``taken`` (unchanged leaves, each with ``base``'s record of it), those whose bytes
    in ``base`` pass every check `verify` makes (chunks' CRC-32C, digests): a save shares
    nothing unchecked, or one bit flipped in ``base`` would be in every later checkpoint.
    The others are written afresh from the values being saved, with a warning naming them.
    Raises `CheckpointChangedError` if ``base`` was replaced or deleted meanwhile."""
    members = [r for r in base.manifest.leaves if isinstance(r, StoredLeaf) and r.offset is not None]
    records = {id(job): members if old.path == PACKED_LOCATION else [old] for job, old in taken}
    damaged = damaged_leaves(base, [r for group in records.values() for r in group]) if taken else {}
    intact: list[tuple[J, StoredLeaf]] = []
    for job, old in taken:
        bad = [r.path for r in records[id(job)] if r.path in damaged]
        if not bad:
            intact.append((job, old))
            continue
        what = f"Leaf {bad[0]!r}" if old.path != PACKED_LOCATION else f"Packed leaf {bad[0]!r}"
        others = f" (and {plural(len(bad) - 1, 'other packed leaf', 'other packed leaves')})" if len(bad) > 1 else ""
        warn_at_caller(
            f"{what}{others} of {base.location}, which this save would share unchanged, is damaged there "
            f"({damaged[bad[0]].rstrip('.')}). This save writes it again from the values being saved; "
            f"{base.location} itself stays damaged (eqxckpt verify names every checkpoint sharing it).",
        )
    return intact


def _recording(manifest: Manifest, found: Mapping[str, tuple[str | None, Seen | None]]) -> Manifest:
    """The manifest with each leaf at a path in ``found`` recording what is known of its
    array's files or objects (its own array only: not the packed array's members) and,
    where given, naming the sibling's prefix its array is in (every packed leaf, if the
    packed array is in ``found``)."""
    where = lambda r: found.get(PACKED_LOCATION if r.offset is not None else r.path)  # noqa: E731
    records = [
        dataclasses.replace(r, arrays=got[0] or r.arrays, seen=got[1] if r.offset is None else None)
        if isinstance(r, StoredLeaf) and (got := where(r))
        else r
        for r in manifest.leaves
    ]
    return dataclasses.replace(manifest, leaves=tuple(records))
