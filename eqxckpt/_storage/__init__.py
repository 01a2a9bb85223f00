"""Where checkpoints live: `resolve` turns a user's path into a `Storage`.

One `Storage` type per backend owns its side of the concurrency protocol
(docs/concurrency.md): how a save stages and commits, what cleanup may remove, how
a checkpoint is deleted, how a directory of checkpoints is listed, how the
manifest is read, and which checks a leaf's files get before TensorStore reads
them. `_backend.py` holds the interface; `_local.py` and `_objects.py` the two
implementations (and `_buffers.py`, a read-only copy held in memory). Their primitives: `_locks.py` (local ``flock`` locks and
staging), `_pins.py` (what pins a checkpoint being read), `_kvstore.py` (key-level
operations on an object store), `_lease.py` (the object-store lease), `_holds.py`
(holds on prefixes that incremental saves refer to), `_reclaim.py` (cleanup on
object stores), `_fs.py` (filesystem calls). Modules outside this package import
only what this `__init__` exports.
"""

from ._backend import (
    MAX_ZARR_JSON_BYTES as MAX_ZARR_JSON_BYTES,
    NOTHING_COMMITTED as NOTHING_COMMITTED,
    CheckpointPath as CheckpointPath,
    Staging as Staging,
    Storage as Storage,
    corrupt as corrupt,
    expected_files as expected_files,
    nothing_committed as nothing_committed,
    reading as reading,
)
from ._buffers import BufferStorage as BufferStorage
from ._fs import fsync_path as fsync_path, read_capped as read_capped
from ._locks import (
    create_locked_file as create_locked_file,
    file_exists_error as file_exists_error,
    remove_abandoned_files as remove_abandoned_files,
    write_file as write_file,
)
from ._pins import UNPINNED as UNPINNED, LocalPin as LocalPin, Pin as Pin
from ._resolve import resolve as resolve
