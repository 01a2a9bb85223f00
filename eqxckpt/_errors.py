"""The exceptions eqxckpt raises. Every one derives from `CheckpointError`."""


class CheckpointError(Exception):
    """Base class of every error eqxckpt raises on purpose."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """Nothing that looks like a checkpoint exists at the given path."""


class IncompleteCheckpointError(CheckpointError):
    """The directory exists but was never committed (no manifest): an interrupted save."""


class ManifestError(CheckpointError):
    """The manifest is unreadable, malformed, unsafe, or of an unknown format version."""


class CorruptCheckpointError(CheckpointError):
    """A leaf's stored data is missing, truncated, or fails its checksum."""


class PathError(CheckpointError, ValueError):
    """A key cannot be turned into a safe, unique path (collision, bad type)."""


class StructureMismatchError(CheckpointError, ValueError):
    """The checkpoint and `like` disagree: missing, unexpected or mismatched leaves."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """Saving would replace an existing checkpoint and `overwrite=False`."""


class CheckpointWriteError(CheckpointError, OSError):
    """Writing a checkpoint failed (disk full, file too large, read-only, ...).

    Nothing was committed; a previous checkpoint at the same place is intact.
    """


class CheckpointChangedError(CheckpointError):
    """The checkpoint was replaced or deleted while it was being read.

    What was read may mix two checkpoints, so nothing of it is returned.
    """


class CheckpointBusyError(CheckpointExistsError):
    """Another process is writing or deleting the checkpoint at this place right now."""


class UnsupportedLeafError(CheckpointError, TypeError):
    """A leaf `save` cannot store faithfully (an object JAX does not flatten, a masked array...)."""


class CastError(CheckpointError, ValueError):
    """A stored value cannot be restored into the requested dtype without changing it."""
