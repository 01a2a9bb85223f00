"""`verify`'s repair: a damaged leaf mended from a twin beside it that verifies.

A twin is the same leaf in a checkpoint beside the damaged one (a step of the same run)
with the same digest and chunk layout, stored in other files (a manager keeps two
physical copies, `RunSteps.plan_copy`): its files are then the very bytes the damaged
leaf's must be. Nothing is mended from a twin that does not verify whole, and a mended
leaf is verified again before it is called mended.
"""

import dataclasses
from collections.abc import Sequence

from .._chunks import ChunkLayout, chunk_file_sound
from .._errors import CheckpointChangedError, CheckpointError
from .._leaf import StoredLeaf
from .._paths import PACKED_LOCATION
from .._storage import MAX_ZARR_JSON_BYTES, Storage, expected_files
from .._stored import StoredArrays, validate_array_metadata
from ._verify import damaged_leaves


@dataclasses.dataclass
class Repair:
    """What a repair did: ``mended`` ``(leaf path, twin's location)`` for each leaf (or the
    packed array, `PACKED_LOCATION`) mended, ``unmended`` ``(leaf path, why)`` for each it
    could not mend."""

    mended: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    unmended: list[tuple[str, str]] = dataclasses.field(default_factory=list)


def repair(location: Storage, damaged: Sequence[str]) -> Repair:
    """Mend the ``damaged`` leaves of the checkpoint at ``location`` from twins beside it.

    **Arguments:**

    - `location`: the damaged checkpoint.
    - `damaged`: the paths of its damaged leaves (`VerifyReport.problems`); packed leaves
      are mended by mending the packed array they are in.

    **Returns:** a `Repair`.

    ```python
    repair(resolve("run/3"), ["model/w"]).mended  # [('model/w', 'run/4')]
    ```
    """
    done = Repair()
    try:
        stored = StoredArrays.open(location)
    except CheckpointError as e:
        done.unmended.extend((path, f"its checkpoint cannot be opened: {e}") for path in damaged)
        return done
    units: dict[str, StoredLeaf] = {}
    for path in damaged:
        record = stored.records.get(path)
        if not isinstance(record, StoredLeaf):
            done.unmended.append((path, "not a stored leaf of the manifest: only leaves' files are mended"))
        elif record.offset is not None and stored.packed is not None:
            units[PACKED_LOCATION] = stored.packed
        else:
            units[path] = record
    twins = [twin for twin in (_opened(beside) for beside in location.beside()) if twin is not None]
    for path, record in units.items():
        twin, why = _mend_from_twins(location, stored, record, twins)
        if twin is not None:
            done.mended.append((path, twin))
        else:
            done.unmended.append((path, why))
    return done


def _mend_from_twins(
    location: Storage, stored: StoredArrays, record: StoredLeaf, twins: list[StoredArrays]
) -> tuple[str | None, str]:
    """Mend ``record``'s array from the first of ``twins`` that holds it soundly: that
    twin's location, or None and why nothing was mended."""
    why = "no checkpoint beside it holds a twin (the same digest and chunk layout)"
    for twin in twins:
        found = _twin_record(stored, twin, record)
        if found is None:
            continue
        try:
            # Held (a local disk) and written in the checkpoint whose manifest was read:
            # one that replaced or deleted it meanwhile is never written to.
            with stored.consistent():
                _mend(stored, record, twin, found)
        except CheckpointChangedError:
            return None, "it was replaced or deleted while it was mended: nothing of what is there now was written"
        except CheckpointError as e:
            why = f"mending it from {twin.location} failed: {e}"
            continue
        if not _damaged(location, record.path):
            return twin.location, ""
        why = f"still damaged after mending it from {twin.location}"
    return None, why


def _opened(location: Storage) -> StoredArrays | None:
    try:
        return StoredArrays.open(location)
    except CheckpointError:
        return None  # damaged, deleted meanwhile, not one: no twin there


def _twin_record(stored: StoredArrays, twin: StoredArrays, record: StoredLeaf) -> StoredLeaf | None:
    """``twin``'s record of ``record`` (of ``stored``) if it holds the same bytes, in the same
    layout, and they verify there; else None."""
    if record.path == PACKED_LOCATION:
        if stored.packing is None or twin.packing is None or not stored.packing.same_bytes_as(twin.packing):
            return None
        found = twin.packed
        members = [r for r in twin.manifest.leaves if isinstance(r, StoredLeaf) and r.offset is not None]
    else:
        found = twin.stored_leaf(record.path)
        if (
            found is None
            or found.offset is not None
            or found.digest is None
            or (found.digest, found.digest_fields()) != (record.digest, record.digest_fields())
        ):
            return None
        members = [found]
    assert found is not None
    try:
        if not _same_layout(stored, record, twin.layout(found)) or damaged_leaves(twin, members):
            return None
    except CheckpointError:
        return None
    return found


def _same_layout(stored: StoredArrays, record: StoredLeaf, theirs: ChunkLayout) -> bool:
    """Whether ``record``'s array is laid out as ``theirs``: as its own ``zarr.json`` declares
    (whatever its chunk files hold now: some may be short or gone), or where that is
    damaged, as the chunk files it holds show (on a local disk; elsewhere its layout is
    unknown and nothing is mended): its chunk files may be shared with other checkpoints,
    which must read the same layout from them after the mend."""
    raw = _read(stored.files_of(record), f"{record.path}/zarr.json", MAX_ZARR_JSON_BYTES)
    if raw is not None:
        try:  # as it declares, whatever its chunk files hold now (some may be short or gone)
            return ChunkLayout.stored(record, validate_array_metadata(raw, record)) == theirs
        except CheckpointError:
            pass
    found = stored.leaf_files(record.path)
    if found is None:
        return False
    metadata = f"{record.path}/zarr.json"
    expected = {k: v for k, v in expected_files([(record, theirs)]).items() if k.startswith(f"{record.path}/")}
    return {k: v for k, v in found.items() if k != metadata} == {k: v for k, v in expected.items() if k != metadata}


def _mend(stored: StoredArrays, record: StoredLeaf, twin: StoredArrays, found: StoredLeaf) -> None:
    """Rewrite each file of ``record``'s array that differs from ``twin``'s (``found``'s)."""
    layout = twin.layout(found)
    theirs, mine = twin.files_of(found), stored.files_of(record)
    metadata = f"{record.path}/zarr.json"
    for key, size in expected_files([(record, layout)]).items():
        if not key.startswith(f"{record.path}/"):
            continue  # the groups' zarr.json: not the leaf's
        cap = size if size >= 0 else MAX_ZARR_JSON_BYTES
        good = _read(theirs, key, cap)
        # Read from the twin that was verified, and sound as read: one replaced (or a file
        # of it changed) since is never copied, into this leaf or the steps sharing its files.
        try:
            twin.check_unchanged()
        except CheckpointChangedError as e:  # the twin's, not this checkpoint's: try another
            raise CheckpointError(f"its twin was replaced or deleted while it was read ({e})") from None
        if good is None or (size >= 0 and len(good) != size) or len(good) > cap:
            raise CheckpointError(f"its twin's {key} is not the file it should be")
        if key == metadata:
            validate_array_metadata(good, record)
        elif not chunk_file_sound(good):
            raise CheckpointError(f"its twin's {key} fails its CRC-32C checksum as read now")
        if _read(mine, key, cap) != good:
            stored.mend(record, key, good)


def _read(files: Storage, key: str, cap: int) -> bytes | None:
    try:
        return files.read_small(key, cap)
    except (OSError, CheckpointError):
        return None


def _damaged(location: Storage, path: str) -> bool:
    """Whether the leaf ``path`` (or the packed array) of the checkpoint now at ``location``
    fails verify's checks (or cannot be opened)."""
    try:
        stored = StoredArrays.open(location)
    except CheckpointError:
        return True
    if path == PACKED_LOCATION:
        records = [r for r in stored.manifest.leaves if isinstance(r, StoredLeaf) and r.offset is not None]
    else:
        record = stored.stored_leaf(path)
        if record is None:
            return True
        records = [record]
    try:
        return bool(damaged_leaves(stored, records))
    except CheckpointError:
        return True
