"""TensorFlow checkpoints (Mesh TensorFlow's included) as a read-only `Source`.

TensorFlow is an optional extra (``pip install 'eqxckpt[tf]'``), imported only
when such a checkpoint is opened; each variable is read when it is needed.
Variable names are paths already (``encoder/block_000/layer_000/SelfAttention/q``).
"""

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._errors import CheckpointError, CheckpointNotFoundError
from ._leaf import UNKNOWN, ArrayLeaf, StoredLeaf
from ._paths import encode_segment
from ._progress import advance
from ._source import Source


class TFCheckpoint(Source):
    """A TensorFlow checkpoint as a read-only source: each variable a leaf at its
    name (``encoder/block_000/layer_000/SelfAttention/q``), read when it is needed.
    """

    def __init__(self, path: Any, reader: Any):
        self.location = str(path)
        self.metadata: dict[str, Any] = {}
        self._reader = reader
        shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
        self._names: dict[str, str] = {}  # path -> the variable's name in the checkpoint
        self._leaves = {}
        for name in sorted(shapes):
            parts = name.split("/")
            path = "/".join(encode_segment(part) for part in parts)
            self._names[path] = name
            keys = tuple(("dict", part) for part in parts)
            dtype = np.dtype(dtypes[name].as_numpy_dtype).name
            self._leaves[path] = ArrayLeaf(path, keys, tuple(shapes[name]), dtype, UNKNOWN)

    def _read(self, wanted: Sequence[tuple[StoredLeaf, Any]]) -> list[Any]:
        values = []
        for leaf, target in wanted:
            name = self._names[leaf.path]
            values.append(leaf.finish(np.asarray(self._reader.get_tensor(name)), target))
            advance(leaf.nbytes)
        return values


def open_tf(path: Any) -> TFCheckpoint:
    """A TF checkpoint (a directory with a ``checkpoint`` file, or a prefix) as a `TFCheckpoint`."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up chatter
    try:
        import tensorflow as tf
    except ImportError:
        raise CheckpointError(
            "Reading TensorFlow checkpoints needs TensorFlow, which is not installed. "
            "Install it with: pip install 'eqxckpt[tf]'"
        ) from None
    try:
        reader = tf.train.load_checkpoint(str(path))
    except (ValueError, tf.errors.OpError) as e:
        raise CheckpointNotFoundError(f"No TensorFlow checkpoint at {path}: {str(e).splitlines()[0]}") from None
    return TFCheckpoint(path, reader)
