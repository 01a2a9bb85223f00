"""`verify`: read every byte of a checkpoint and check it against its manifest."""

import dataclasses

from ._checkpoint import Checkpoint, open_checkpoint, reading
from ._errors import CheckpointChangedError, CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ._leaf import StoredLeaf
from ._paths import MANIFEST_NAME
from ._progress import Progress, advance, reporting
from ._storage import CheckpointPath, resolve

# Large leaves are read in slabs of whole chunks, so verifying needs little memory.
SLAB_BYTES = 256 * 1024 * 1024


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
            f"{self.location}: {self.leaves} leaves, {self.arrays_checked} arrays, "
            f"{self.bytes_checked} bytes checked, {len(self.problems)} problems"
        )
        return "\n".join([head] + [f"  {path}: {message}" for path, message in self.problems])


def verify(path: CheckpointPath, *, progress: Progress = False) -> VerifyReport:
    """Read every chunk of every leaf, checking checksums, shapes and dtypes
    against the manifest; report each problem with its leaf path.

    Never raises for a damaged checkpoint: the report lists what is wrong.
    Raises `CheckpointNotFoundError` when there is no checkpoint at ``path``.

    **Arguments:**

    - `path`: where the checkpoint is (as for `eqxckpt.open`).
    - `progress`: as for `eqxckpt.save` (True: a bar on a terminal). Off by default.

    **Returns:** a `VerifyReport`; ``report.ok`` is True if nothing is wrong.

    ```python
    report = eqxckpt.verify("ckpt/step_100")
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
    try:
        with (
            checkpoint.consistent(),
            reporting(f"verifying {location}", sum(r.nbytes for r in stored), len(stored), progress),
        ):
            for record in stored:
                try:
                    _check_leaf(checkpoint, record)
                except CheckpointError as e:
                    report.problems.append((record.path, str(e)))
                    continue
                finally:
                    advance(record.nbytes)
                report.arrays_checked += 1
                report.bytes_checked += record.nbytes
            report.problems.extend(location.unlisted(set(checkpoint._manifest.stored_paths())))
    except CheckpointChangedError as e:
        # What was checked may belong to another checkpoint: say so, and nothing else.
        report.problems[:] = [(MANIFEST_NAME, str(e))]
    return report


def _check_leaf(checkpoint: Checkpoint, record: StoredLeaf) -> None:
    record.check_known()  # e.g. a PRNG implementation this JAX knows
    with reading(record):
        store = checkpoint._store(record)
        codecs = [c.get("name") for c in store.spec().to_json()["metadata"].get("codecs", [])]
        if "crc32c" not in codecs:
            raise CorruptCheckpointError(
                f"Leaf {record.path!r} has no crc32c checksum in its zarr.json (codecs {codecs}); eqxckpt "
                "always writes one, so the array metadata was replaced. Do not trust this leaf.",
                path=record.path,
            )
        shape = store.shape
        if record.nbytes <= SLAB_BYTES or not shape:
            store.read().result()
            return
        chunk = store.chunk_layout.read_chunk.shape
        rows = chunk[0] if chunk is not None and chunk[0] is not None else shape[0]
        row_bytes = record.nbytes // max(1, shape[0])
        step = max(1, SLAB_BYTES // max(1, row_bytes * rows)) * rows
        for start in range(0, shape[0], step):
            store[start : min(start + step, shape[0])].read().result()
