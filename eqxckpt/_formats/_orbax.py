"""Orbax checkpoints as a read-only `Source`, without importing Orbax.

Orbax's `StandardCheckpointer` and `PyTreeCheckpointer` write a directory with
``_METADATA`` (JSON: every leaf's keys and value type) and one zarr array per
array leaf, named by its keys joined with ``.`` (``model.layers.0.weight``):
inside an OCDBT key-value store (``manifest.ocdbt``, the default) or as plain
directories. TensorStore reads both (its ``ocdbt`` and ``zarr`` drivers).
Python scalars are zarr arrays too; they are read when the checkpoint is opened.
"""

import math
import os
import pathlib
import re
import stat
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from .._dtypes import STORED_DTYPES
from .._errors import CheckpointNotFoundError, ManifestError
from .._leaf import ArrayLeaf, KeyRecord, Leaf, ScalarLeaf, StoredLeaf, parse_shape
from .._manifest import MAX_MANIFEST_BYTES, parse_json_object
from .._paths import check_one_tree, record_segment
from .._read._source import Source, reading
from .._storage import LocalPin, read_capped
from .._tensorstore import shared_context

METADATA_NAME = "_METADATA"
OCDBT_MANIFEST = "manifest.ocdbt"
# Orbax's key types in _METADATA: 1 a sequence index, 2 a dict key.
KEY_TYPES = {1: "seq", 2: "dict"}
ARRAY_VALUES = {"jax.Array": "jax", "np.ndarray": "numpy"}
_PARAM_NAME = re.compile(r"^[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*$")


def is_orbax(path: pathlib.Path) -> bool:
    """Whether ``path`` is a directory Orbax wrote a pytree checkpoint into."""
    return (path / METADATA_NAME).is_file()


class OrbaxCheckpoint(Source):
    """A checkpoint written by `orbax-checkpoint` (OCDBT or per-leaf layout), read through TensorStore."""

    def __init__(self, root: pathlib.Path):
        self.location = str(root)
        self.metadata: dict[str, Any] = {}
        self._leaves = {}
        # Held open: a load checks afterwards that the path still names this directory
        # and its _METADATA, so a checkpoint deleted or rewritten meanwhile is never mixed in.
        try:
            self._pin = LocalPin(root, os.open(root, os.O_RDONLY | os.O_DIRECTORY), METADATA_NAME)
        except OSError as e:
            raise CheckpointNotFoundError(f"Cannot open {root}: {e.strerror}.") from None
        weakref.finalize(self, self._pin.close)
        _refuse_symlinks(root)
        doc = _read_json(root / METADATA_NAME)
        tree = doc.get("tree_metadata")
        if not isinstance(tree, dict):
            raise ManifestError(
                f"{root / METADATA_NAME} has no 'tree_metadata' object: not an Orbax pytree checkpoint."
            )
        custom = doc.get("custom_metadata")
        self.metadata = dict(custom) if isinstance(custom, dict) else {}
        ocdbt = bool(doc.get("use_ocdbt"))
        driver = "zarr3" if doc.get("use_zarr3") else "zarr"
        opening: list[tuple[str, tuple[KeyRecord, ...], str, Any, ts.Future]] = []
        seen: set[str] = set()
        for entry in tree.values():
            keys, param, value_type, write_shape = _entry(entry, root)
            if value_type is None:
                continue  # skip_deserialize: Orbax does not restore it either
            path = "/".join(record_segment(k) for k in keys)
            if path in seen:
                raise ManifestError(f"{root / METADATA_NAME}: two entries name leaf {path!r}.")
            seen.add(path)
            where = {"driver": "file", "path": f"{root}/{'' if ocdbt else param + '/'}"}
            kvstore = {"driver": "ocdbt", "base": where, "path": param + "/"} if ocdbt else where
            spec = {"driver": driver, "kvstore": kvstore, "open": True}
            future = ts.open(spec, context=shared_context(), read=True)
            opening.append((path, keys, value_type, write_shape, future))
        self._stores: dict[str, ts.TensorStore] = {}
        leaves: list[tuple[str, Leaf | tuple[tuple[KeyRecord, ...], ts.Future]]] = []
        for path, keys, value_type, write_shape, future in opening:
            with reading(ArrayLeaf(path, keys, (), "float32")):
                store = future.result()
            dtype = np.dtype(store.dtype.numpy_dtype).name
            if dtype not in STORED_DTYPES:
                raise ManifestError(f"{self.location}: leaf {path!r} has dtype {dtype}, which eqxckpt does not read.")
            shape = parse_shape(list(store.shape), path)
            chunk = store.chunk_layout.read_chunk.shape or ()
            if math.prod(c or 1 for c in chunk) > max(1, math.prod(shape)):
                # A chunk larger than its array would make a read allocate more than the array.
                raise ManifestError(
                    f"{self.location}: leaf {path!r} declares chunks {list(chunk)} larger than its shape "
                    f"{list(shape)}; Orbax never writes that. The checkpoint is damaged or crafted."
                )
            # Orbax stores 0-d arrays as shape [1] in zarr v2; its metadata keeps the real shape.
            if isinstance(write_shape, list) and math.prod(write_shape) == math.prod(shape):
                shape = parse_shape(write_shape, path)
            if value_type == "scalar":
                if math.prod(shape) != 1:
                    raise ManifestError(f"{self.location}: scalar leaf {path!r} holds an array of shape {shape}.")
                leaves.append((path, (keys, store.read())))  # every scalar is read at once, below
                continue
            leaves.append((path, ArrayLeaf(path, keys, shape, dtype, ARRAY_VALUES[value_type])))
            self._stores[path] = store
        for path, leaf in leaves:
            if isinstance(leaf, tuple):
                keys, read = leaf
                with reading(ArrayLeaf(path, keys, (), "float32")):
                    value = np.asarray(read.result()).reshape(-1)[0].item()
                if not isinstance(value, (bool, int, float, complex)):
                    raise ManifestError(f"{self.location}: scalar leaf {path!r} holds {type(value).__name__}.")
                leaf = ScalarLeaf.of(path, keys, value)
            self._leaves[path] = leaf
        check_one_tree(self._leaves, self.location, lambda path: ".".join(str(k[1]) for k in self._leaves[path].keys))

    def _fetch(
        self, leaves: Sequence[StoredLeaf], done: Callable[[int, np.ndarray], None], reserve: Callable[[int], None]
    ) -> None:
        reserve(sum(leaf.nbytes for leaf in leaves))
        reads = [self._stores[leaf.path].read() for leaf in leaves]  # all issued: TensorStore runs them together
        for i, (leaf, read) in enumerate(zip(leaves, reads)):
            with reading(leaf):
                data = np.ascontiguousarray(read.result()).reshape(leaf.shape)
            done(i, data)


def _entry(entry: Any, root: pathlib.Path) -> tuple[tuple[KeyRecord, ...], str, str | None, Any]:
    """One _METADATA entry: its key records, Orbax's parameter name, its value type (None:
    skipped) and the shape Orbax wrote it from."""
    where = root / METADATA_NAME
    if not isinstance(entry, dict) or not isinstance(entry.get("key_metadata"), list):
        raise ManifestError(f"{where}: an entry has no 'key_metadata' list.")
    keys: list[KeyRecord] = []
    for key in entry["key_metadata"]:
        kind = KEY_TYPES.get(key.get("key_type", 0)) if isinstance(key, dict) else None
        value = key.get("key") if isinstance(key, dict) else None
        if kind is None or not isinstance(value, str):
            raise ManifestError(f"{where}: key {key!r} is not a dict key or a sequence index.")
        if kind == "seq":
            if not (value.isascii() and value.isdigit() and len(value) <= 18):
                raise ManifestError(f"{where}: sequence index {value!r} is not a number (ASCII digits).")
            keys.append(("seq", int(value)))
        else:
            keys.append(("dict", value))
    if not keys:
        raise ManifestError(f"{where}: an entry has no keys.")
    param = ".".join(str(k[1]) for k in keys)
    if not _PARAM_NAME.match(param):
        raise ManifestError(
            f"{where}: leaf {param!r} has a name eqxckpt will not use as a storage path (only letters, digits, "
            "'_', '-' and '.' between keys). Refusing to read it."
        )
    value_metadata = entry.get("value_metadata")
    if not isinstance(value_metadata, dict):
        raise ManifestError(f"{where}: leaf {param!r} has no 'value_metadata'.")
    if value_metadata.get("skip_deserialize"):
        return tuple(keys), param, None, None
    value_type = value_metadata.get("value_type")
    if value_type not in ARRAY_VALUES and value_type != "scalar":
        raise ManifestError(
            f"{where}: leaf {param!r} is of Orbax value type {value_type!r}; eqxckpt reads arrays and scalars."
        )
    return tuple(keys), param, value_type, value_metadata.get("write_shape")


def _read_json(file: pathlib.Path) -> dict[str, Any]:
    try:
        raw = read_capped(file, MAX_MANIFEST_BYTES)
    except OSError as e:
        raise CheckpointNotFoundError(f"Cannot read {file}: {e.strerror or e}.") from None
    return parse_json_object(raw, str(file))


def _refuse_symlinks(root: pathlib.Path) -> None:
    """Nothing in the checkpoint may be a symlink (TensorStore would follow it out of the
    directory) or anything but plain files and directories (reading a FIFO blocks forever)."""
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            where = os.path.join(dirpath, name)
            mode = os.lstat(where).st_mode
            if stat.S_ISLNK(mode):
                raise ManifestError(
                    f"{where} is a symlink inside the Orbax checkpoint {root}; refusing to read it (it could point "
                    "outside the checkpoint)."
                )
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise ManifestError(
                    f"{where} in the Orbax checkpoint {root} is not a plain file or directory (a FIFO, socket or "
                    "device); refusing to read it."
                )
