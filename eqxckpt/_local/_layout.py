"""`LocalTier`: one process's directory of a run's local tier, and the pieces in it.

```
<local_path>/eqxckpt-local/<run>/process-<k>/own/<step>/     process k's part of <step>
<local_path>/eqxckpt-local/<run>/process-<k>/peer-<j>/<step>/  process j's part, kept by k
```

Each piece is an eqxckpt checkpoint (committed atomically, checksummed) of one
process's `HostShards`, whose metadata says whose part of which save it is. ``<run>``
names the persistent directory the tier belongs to, so jobs saving to different
places never share pieces; ``process-<k>`` lets several processes share one local
directory. Nothing outside ``eqxckpt-local/<run>/process-<k>`` is ever touched, and
inside it only eqxckpt's committed pieces and what its interrupted saves left.
"""

import dataclasses
import hashlib
import os
import pathlib
import warnings

from .._checkpoint import open_checkpoint
from .._errors import ArgumentError, CheckpointError
from .._load import load
from .._save import save_here
from .._steps import clean_leftovers, is_step_name
from .._storage import Storage, resolve
from ._shards import HostShards

# The key of a piece's own record in its checkpoint's metadata.
PIECE_KEY = "eqxckpt.local"


@dataclasses.dataclass(frozen=True)
class PieceInfo:
    """A piece as its metadata describes it: whose part (``owner``) of which save (``step``,
    ``token``: the one save of that step it belongs to) of a job of ``processes``
    processes, and who keeps it (``holder``: the process whose tier it is in)."""

    owner: int
    step: int
    token: str
    processes: int
    holder: int

    def to_json(self) -> list:
        return [self.owner, self.step, self.token, self.processes, self.holder]

    @classmethod
    def from_json(cls, data: list) -> "PieceInfo":
        owner, step, token, processes, holder = data
        return cls(int(owner), int(step), str(token), int(processes), int(holder))


def run_key(persistent: Storage) -> str:
    """The name of a run's local tier: a digest of its persistent directory's address."""
    return hashlib.sha256(str(persistent).encode()).hexdigest()[:16]


class LocalTier:
    """Process ``process``'s directory of the local tier under ``local_path`` of the run
    saved persistently at ``persistent``.

    **Arguments:**

    - `local_path`: a directory on a disk or tmpfs of this host.
    - `persistent`: the run's persistent directory.
    - `process`: this process's index.

    ```python
    tier = LocalTier("/dev/shm/run", resolve("gs://bucket/run"), jax.process_index())
    tier.pieces()  # what this process keeps
    ```
    """

    def __init__(self, local_path: str | os.PathLike, persistent: Storage, process: int):
        if not isinstance(local_path, (str, os.PathLike)) or "://" in str(local_path):
            raise ArgumentError(f"local_path must be a directory of this host (a path), got {local_path!r}.")
        self.process = process
        self.root = pathlib.Path(local_path) / "eqxckpt-local" / run_key(persistent) / f"process-{process}"
        self.root.mkdir(parents=True, exist_ok=True)
        for _, directory in self._directories():
            if left_alone := clean_leftovers(directory):
                warnings.warn(left_alone, stacklevel=3)

    def _directory(self, owner: int) -> Storage:
        return resolve(self.root / ("own" if owner == self.process else f"peer-{owner}"))

    def _directories(self) -> list[tuple[int, Storage]]:
        """(whose pieces, the directory) for each directory of pieces here."""
        found = []
        for entry in sorted(self.root.iterdir()):
            if entry.name == "own":
                found.append((self.process, resolve(entry)))
            elif (
                entry.name.startswith("peer-")
                and entry.name[5:].isdigit()
                and entry.name[5:] == str(int(entry.name[5:]))
            ):
                found.append((int(entry.name[5:]), resolve(entry)))
        return found

    def pieces(self) -> list[PieceInfo]:
        """Every committed piece this process keeps (its own and its peers'), as stored now.
        A piece that cannot be read is left out with a warning.

        **Returns:** a list of `PieceInfo`.
        """
        found = []
        for owner, directory in self._directories():
            for name, state in directory.entries():
                if state != "committed" or not is_step_name(name):
                    continue
                try:
                    record = open_checkpoint(directory.sub(name)).metadata.get(PIECE_KEY) or {}
                    info = PieceInfo(
                        int(record["owner"]),
                        int(record["step"]),
                        str(record["token"]),
                        int(record["processes"]),
                        self.process,
                    )
                except (CheckpointError, TypeError, KeyError, ValueError) as e:
                    warnings.warn(f"Local tier: skipped {directory.sub(name)}: {e}", stacklevel=2)
                    continue
                if info.step == int(name) and info.owner == owner:
                    found.append(info)
        return found

    def write(self, owner: int, step: int, token: str, processes: int, part: HostShards) -> None:
        """Keep ``part``, process ``owner``'s part of the save ``token`` of ``step``, replacing
        a piece of another save of that step (one that never completed)."""
        record = {"owner": owner, "step": step, "token": token, "processes": processes, "leaves": part.leaves}
        path = self._directory(owner).sub(str(step)).user_path()
        # Not synced: a host that fails loses its tier anyway, and a part a power cut damaged
        # fails its checksums when `latest_step` reads it, and is left out.
        save_here(path, part.arrays, metadata={PIECE_KEY: record}, overwrite=True, durable=False)

    def read(self, owner: int, step: int, token: str) -> HostShards:
        """Process ``owner``'s part of the save ``token`` of ``step``, as kept here (every
        chunk's checksum checked as it is read)."""
        path = self._directory(owner).sub(str(step))
        record = open_checkpoint(path).metadata.get(PIECE_KEY, {})
        if record.get("token") != token or record.get("owner") != owner:
            raise CheckpointError(
                f"Local tier: {path} is no longer process {owner}'s part of step {step}'s save {token} "
                f"(it holds {record.get('token')!r}); it was replaced meanwhile. Load again."
            )
        arrays = load(path.user_path())
        return HostShards(list(record["leaves"]), list(arrays))

    def delete(self, pieces: list[PieceInfo]) -> None:
        """Delete these pieces (this process's own)."""
        for info in pieces:
            assert info.holder == self.process
            self._directory(info.owner).sub(str(info.step)).delete()
