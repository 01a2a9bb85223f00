"""TensorFlow checkpoints (Mesh TensorFlow's included) as a read-only `Source`.

TensorFlow is an optional extra (``pip install 'eqxckpt[tf]'``), imported only
when such a checkpoint is opened; each variable is read when it is needed.
Variable names are paths already (``encoder/block_000/layer_000/SelfAttention/q``).
"""

import os
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, ManifestError
from .._leaf import UNKNOWN, ArrayLeaf, StoredLeaf
from .._paths import check_one_tree, encode_segment
from .._read._source import Source

# TF2 checkpoints' record of the Python object graph: a serialised proto, not a variable.
OBJECT_GRAPH = "_CHECKPOINTABLE_OBJECT_GRAPH"


class TFCheckpoint(Source):
    """A TensorFlow checkpoint as a read-only source: each variable a leaf at its
    name (``encoder/block_000/layer_000/SelfAttention/q``), read when it is needed.
    """

    arrays_only = True

    def __init__(self, path: Any, reader: Any):
        self.location = str(path)
        self.metadata: dict[str, Any] = {}
        self._reader = reader
        shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
        self._names: dict[str, str] = {}  # path -> the variable's name in the checkpoint
        self._leaves = {}
        for name in sorted(shapes):
            if name == OBJECT_GRAPH:
                continue  # TF2's record of its Python objects, not a variable (TensorFlow's tools skip it too)
            parts = name.split("/")
            path = "/".join(encode_segment(part) for part in parts)
            self._names[path] = name
            keys = tuple(("dict", part) for part in parts)
            dtype = np.dtype(dtypes[name].as_numpy_dtype).name
            self._leaves[path] = ArrayLeaf(path, keys, tuple(shapes[name]), dtype, UNKNOWN)
        check_one_tree(self._leaves, self.location, lambda path: self._names[path])

    def _fetch(
        self, leaves: Sequence[StoredLeaf], done: Callable[[int, np.ndarray], None], reserve: Callable[[int], None]
    ) -> None:
        # The index's shapes, before TensorFlow allocates a tensor of each.
        reserve(sum(leaf.nbytes for leaf in leaves))
        for i, leaf in enumerate(leaves):
            name = self._names[leaf.path]
            try:
                data = np.asarray(self._reader.get_tensor(name))
            except Exception as e:  # noqa: BLE001 - TensorFlow raises IndexError, OpError, ... for damaged data
                raise CorruptCheckpointError(
                    f"Leaf {leaf.path!r}: TensorFlow could not read variable {name!r} of {self.location} "
                    f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). The checkpoint's data "
                    "files are truncated or damaged.",
                    leaf_path=leaf.path,
                ) from None
            if data.shape != leaf.shape or data.dtype != np.dtype(leaf.dtype):
                raise CorruptCheckpointError(
                    f"Leaf {leaf.path!r}: variable {name!r} read as {data.dtype}{list(data.shape)}, but the index "
                    f"says {leaf.describe()}. The checkpoint is damaged.",
                    leaf_path=leaf.path,
                )
            done(i, data)


def open_tf(path: Any) -> TFCheckpoint:
    """A TF checkpoint (a directory with a ``checkpoint`` file, or a prefix) as a `TFCheckpoint`."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up chatter
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")  # (its notice comes at any log level; only reading here)
    try:
        import tensorflow as tf
    except ImportError:
        raise CheckpointError(
            "Reading TensorFlow checkpoints needs TensorFlow, which is not installed. "
            "Install it with: pip install 'eqxckpt[tf]'"
        ) from None
    prefix = _prefix(pathlib.Path(path), tf)
    try:
        reader = tf.train.load_checkpoint(str(prefix))
    except (ValueError, tf.errors.OpError) as e:
        raise CheckpointNotFoundError(f"No TensorFlow checkpoint at {path}: {str(e).splitlines()[0]}") from None
    return TFCheckpoint(path, reader)


def _prefix(path: pathlib.Path, tf: Any) -> pathlib.Path:
    """The checkpoint prefix ``path`` names: itself, or for a directory the one its
    ``checkpoint`` file names, which must lie in that directory (the file may name any
    path, ``../`` or absolute, and is read as data, not followed out). The prefix's
    files must be plain files: a symlink could lead out, a FIFO would block forever."""
    if path.is_dir():
        marker = path / "checkpoint"
        if marker.is_symlink() or (os.path.lexists(marker) and not marker.is_file()):
            raise ManifestError(f"{marker} is a symlink or special file, not a TensorFlow checkpoint file.")
        try:
            state = tf.train.get_checkpoint_state(str(path))
        except (ValueError, tf.errors.OpError) as e:
            raise ManifestError(f"{path / 'checkpoint'} cannot be parsed: {str(e).splitlines()[0]}") from None
        if state is None or not state.model_checkpoint_path:
            raise CheckpointNotFoundError(f"No TensorFlow checkpoint at {path}: its checkpoint file names none.")
        named = pathlib.Path(state.model_checkpoint_path)
        prefix = path / named.name
        # TensorFlow has joined a relative name to the directory already.
        if os.path.realpath(named.parent) != os.path.realpath(path):
            inside = (path / f"{named.name}.index").is_file()
            raise ManifestError(
                f"{path / 'checkpoint'} names {state.model_checkpoint_path!r}, outside {path}. eqxckpt reads only "
                "the directory it is given; pass a prefix to read a checkpoint by name"
                + (f" (this directory holds {str(prefix)!r})." if inside else ".")
            )
    else:
        prefix = path
    parent = prefix.parent if str(prefix.parent) else pathlib.Path(".")
    try:
        files = [entry for entry in os.scandir(parent) if entry.name.startswith(prefix.name + ".")]
    except OSError as e:
        raise CheckpointNotFoundError(f"Cannot read {parent}: {e.strerror or e}.") from None
    for entry in files:
        if not entry.is_file(follow_symlinks=False):
            raise ManifestError(
                f"{entry.path} is a symlink or special file (a FIFO, device or directory), not a plain file of the "
                "TensorFlow checkpoint; refusing to read it."
            )
    return prefix
