"""The exceptions eqxckpt raises. Every one derives from `CheckpointError`.

All of them live here, and their structured fields are plain attributes, so an
error pickles with them (it can cross from a worker process to its parent).
"""

import os
import sys
import warnings


class CheckpointError(Exception):
    """Base class of every error eqxckpt raises on purpose.

    ```python
    try:
        ...
    except eqxckpt.CheckpointError as e:  # anything eqxckpt refused, with what to do
        print(e)
    ```
    """


class ArgumentError(CheckpointError, ValueError):
    """An argument to `save`, `load`, `CheckpointManager` or another eqxckpt call is not
    one it accepts (a negative step, metadata that is not JSON, an unknown mode).

    Also a `ValueError`, so code that catches either catches it.

    ```python
    try:
        eqxckpt.CheckpointManager("run", max_to_keep=0)
    except eqxckpt.ArgumentError as e:
        print(e)  # names the argument, what it got, and what it accepts
    ```
    """


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """Nothing that looks like a checkpoint exists at the given path.

    ```python
    try:
        ...
    except eqxckpt.CheckpointNotFoundError:
        state = init_state()
    ```
    """


class IncompleteCheckpointError(CheckpointError):
    """The directory exists but was never committed (no manifest): an interrupted save.

    ```python
    try:
        ...
    except eqxckpt.IncompleteCheckpointError:
        state = manager.load(skeleton, step=previous_step)
    ```
    """


class ManifestError(CheckpointError):
    """The manifest is unreadable, malformed, unsafe, or of an unknown format version.

    ```python
    try:
        ...
    except eqxckpt.ManifestError as e:
        print("damaged or too new:", e)
    ```
    """


class CorruptCheckpointError(CheckpointError):
    """A leaf's stored data is missing, truncated, or fails its checksum.

    **Attributes:** `leaf_path`, the leaf's path when one leaf is at fault (else
    None).

    ```python
    try:
        ...
    except eqxckpt.CorruptCheckpointError as e:
        print("damaged leaf:", e.leaf_path)
    ```
    """

    def __init__(self, message: str, *, leaf_path: str | None = None):
        super().__init__(message)
        self.leaf_path = leaf_path


class PathError(CheckpointError, ValueError):
    """A key cannot be turned into a safe, unique path (collision, bad type).

    ```python
    try:
        eqxckpt.save("ckpt", tree)
    except eqxckpt.PathError as e:
        print(e)  # names the keys that collide
    ```
    """


class StructureMismatchError(CheckpointError, ValueError):
    """The checkpoint and `like` disagree: missing, unexpected or mismatched leaves.

    **Attributes:** `missing`, `unexpected` and `mismatched`: lists of
    ``(path, what)`` pairs, paths relative to ``at``.

    ```python
    try:
        eqxckpt.load("ckpt", like)
    except eqxckpt.StructureMismatchError as e:
        print([path for path, _ in e.missing])
    ```
    """

    def __init__(
        self,
        message: str,
        *,
        missing: list[tuple[str, str]] | None = None,
        unexpected: list[tuple[str, str]] | None = None,
        mismatched: list[tuple[str, str]] | None = None,
    ):
        super().__init__(message)
        self.missing = list(missing or [])
        self.unexpected = list(unexpected or [])
        self.mismatched = list(mismatched or [])


class CheckpointExistsError(CheckpointError, FileExistsError):
    """Saving would replace an existing checkpoint and `overwrite=False`.

    A place another process is saving to or deleting right now raises
    `CheckpointBusyError` instead, which is not a kind of this one: retrying with
    ``overwrite=True``, as below, never saves over a save in progress.

    ```python
    try:
        ...
    except eqxckpt.CheckpointExistsError:
        eqxckpt.save(path, tree, overwrite=True)
    ```
    """


class CheckpointWriteError(CheckpointError, OSError):
    """Writing a checkpoint failed (disk full, file too large, read-only, ...).

    Nothing was committed; a previous checkpoint at the same place is intact.

    ```python
    try:
        ...
    except eqxckpt.CheckpointWriteError as e:  # e.errno: ENOSPC, EROFS...
        free_space_and_retry()
    ```
    """


class CheckpointChangedError(CheckpointError):
    """The checkpoint was replaced or deleted while it was being read.

    What was read may mix two checkpoints, so nothing of it is returned.

    ```python
    try:
        ...
    except eqxckpt.CheckpointChangedError:
        state = eqxckpt.load(path, skeleton)  # read it again
    ```
    """


class CheckpointBusyError(CheckpointError):
    """Another process is writing or deleting the checkpoint at this place right now
    (on an object store, where a save holds a lease on its place).

    Not a `CheckpointExistsError`: ``overwrite=True`` does not help; wait, or save elsewhere.

    ```python
    try:
        ...
    except eqxckpt.CheckpointBusyError:
        time.sleep(10)  # another process is saving or deleting there
    ```
    """


class UnsupportedLeafError(CheckpointError, TypeError):
    """A leaf `save` cannot store faithfully (an object JAX does not flatten, a masked array...).

    ```python
    eqxckpt.save("ckpt", eqx.filter(tree, eqx.is_array))  # keep arbitrary objects out
    ```
    """


class CastError(CheckpointError, ValueError):
    """A stored value cannot be restored into the requested dtype without changing it.

    ```python
    eqxckpt.load("ckpt", like_f32, cast=True)  # raises CastError if a value would change
    ```
    """


class TransformError(CheckpointError, ValueError):
    """A `Transform` or `CheckpointTranslator` rule is malformed or cannot be applied.

    ```python
    try:
        ...
    except eqxckpt.TransformError as e:
        print(e)  # names the rule and the key
    ```
    """


class UnsupportedFormatError(CheckpointError, ValueError):
    """What is at the path is a format eqxckpt does not read (a PyTorch pickle, say), or not the one asked for.

    ```python
    try:
        eqxckpt.open("pytorch_model.bin")
    except eqxckpt.UnsupportedFormatError as e:
        print(e)  # says why (no pickle) and how to convert it
    ```
    """


MAX_LISTED = 50  # paths one error or warning names at most


def plural(n: int, one: str, many: str | None = None) -> str:
    """``1 leaf``, ``2 leaves``: a count in a message."""
    return f"{n} {one if n == 1 else many or one + 's'}"


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
# Frames of a thread eqxckpt started (a background save): no caller's line is on its stack.
_THREAD_FILES = (f"{os.sep}threading.py", f"{os.sep}concurrent{os.sep}futures{os.sep}")


def warn_at_caller(message: str) -> None:
    """Warn (`UserWarning`) pointing at the line of the user's code that called eqxckpt
    (the first frame outside the package), however deep in eqxckpt the warning is made;
    in a thread eqxckpt runs (a background save), at eqxckpt's own line.

    ```python
    warn_at_caller("Leaf 'w' of run/3, which this save would share unchanged, is damaged there ...")
    ```
    """
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    if frame is None or any(part in frame.f_code.co_filename for part in _THREAD_FILES):
        level = 2
    warnings.warn(message, UserWarning, stacklevel=level)
