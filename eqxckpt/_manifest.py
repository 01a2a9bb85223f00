"""The manifest, ``eqxckpt.json``: what a checkpoint holds, written last.

It is plain JSON a person can read. Everything read from it is validated before
use: types, paths (never outside the checkpoint), dtypes, shapes and sizes.
"""

import dataclasses
import errno
import json
import math
import os
import time
import uuid
from typing import Any

import numpy as np

from ._errors import CheckpointError, CheckpointNotFoundError, IncompleteCheckpointError, ManifestError
from ._lease import LocalPin, StorePin, describe_lease, is_stale, read_lease
from ._paths import MANIFEST_NAME, record_segment, validate_path
from ._store import STORED_DTYPES, Location, is_storage_error, read_capped, reason

FORMAT = "eqxckpt"
VERSION = 1
LEAF_KINDS = ("array", "prng_key", "scalar", "opaque")
KEY_KINDS = ("attr", "dict", "seq", "index")
ARRAY_TYPES = ("jax", "numpy", "numpy_scalar")
SCALAR_TYPES = ("int", "float", "bool", "complex", "str", "none")
# 64 MiB hold the manifest of about 250,000 leaves (about 250 bytes each).
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
MAX_PARSE_FACTOR = 16
MAX_RANK = 64
MAX_ELEMENTS = 1 << 53
# A sequence's largest index may exceed its number of leaves (empty subtrees
# leave gaps), by at most this much.
MAX_GAP_FACTOR, MAX_GAP = 2, 64


@dataclasses.dataclass(frozen=True)
class LeafRecord:
    """One leaf of a checkpoint, as the manifest describes it.

    ``kind`` is ``array`` (a zarr3 array at ``path``), ``prng_key`` (typed key:
    its key data is the array, ``impl`` names the PRNG), ``scalar`` (the value
    lives in the manifest) or ``opaque`` (a function or object: only its type
    name is kept, the value comes from ``like`` on load).
    """

    path: str
    keys: tuple
    kind: str
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    array_type: str | None = None
    impl: str | None = None
    value: Any = None
    type_name: str | None = None

    @property
    def is_stored(self) -> bool:
        """Whether the leaf has an array on disk."""
        return self.kind in ("array", "prng_key")

    @property
    def data_shape(self) -> tuple[int, ...]:
        """Shape of the stored array (typed keys add their key-data dims)."""
        return self.shape if self.kind == "array" else self.shape + self.key_shape

    @property
    def key_shape(self) -> tuple[int, ...]:
        return tuple(self.value) if self.kind == "prng_key" else ()

    @property
    def nbytes(self) -> int:
        if not self.is_stored:
            return 0
        return math.prod(self.data_shape) * np.dtype(self.dtype).itemsize

    def describe(self) -> str:
        """``float32[4,3]``-style summary used in errors and listings."""
        if self.kind == "array":
            return f"{self.dtype}[{','.join(map(str, self.shape))}]"
        if self.kind == "prng_key":
            return f"key<{self.impl}>[{','.join(map(str, self.shape))}]"
        if self.kind == "scalar":
            return f"{self.type_name} = {scalar_from_json(self.type_name, self.value)!r}"
        return f"<{self.type_name}>"

    def to_json(self) -> dict:
        out: dict[str, Any] = {"path": self.path, "keys": [list(k) for k in self.keys], "kind": self.kind}
        if self.is_stored:
            out.update(shape=list(self.shape), dtype=self.dtype, location=self.path)
        if self.kind == "array":
            out["array_type"] = self.array_type
        if self.kind == "prng_key":
            out.update(impl=self.impl, key_shape=list(self.value))
        if self.kind == "scalar":
            out.update(type=self.type_name, value=self.value)
        if self.kind == "opaque":
            out["type"] = self.type_name
        return out


@dataclasses.dataclass(frozen=True)
class Manifest:
    leaves: tuple[LeafRecord, ...]
    metadata: dict
    created: float = dataclasses.field(default_factory=time.time)
    # Unique per save: two checkpoints written at one place never share a manifest's bytes.
    save_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    # Every sequence's empty subtrees are recorded (as None), so its indices are
    # exactly 0..n-1. False only for manifests written before that was so.
    sequences_complete: bool = True

    def to_bytes(self) -> bytes:
        from . import __version__

        head = {
            "format": FORMAT,
            "version": VERSION,
            "eqxckpt_version": __version__,
            "created_unix": self.created,
            "save_id": self.save_id,
            "sequences_complete": self.sequences_complete,
            "metadata": self.metadata,
        }
        # One leaf per line: easy to read, grep and diff.
        lines = [json.dumps(leaf.to_json(), allow_nan=False) for leaf in self.leaves]
        body = json.dumps(head, indent=1, allow_nan=False)[:-2]
        return (body + ',\n "leaves": [\n  ' + ",\n  ".join(lines) + "\n ]\n}\n").encode()


# --- scalars --------------------------------------------------------------------------


def float_to_json(x: float) -> float | str:
    return x if math.isfinite(x) else repr(x)  # 'nan', 'inf', '-inf'


def scalar_to_json(value: Any) -> tuple[str, Any]:
    """(type name, JSON value) of a Python scalar leaf; floats survive bit for bit."""
    if value is None:
        return "none", None
    if isinstance(value, bool):
        return "bool", value
    if isinstance(value, int):
        return "int", value
    if isinstance(value, float):
        return "float", float_to_json(value)
    if isinstance(value, complex):
        return "complex", [float_to_json(value.real), float_to_json(value.imag)]
    if isinstance(value, str):
        return "str", value
    raise TypeError(type(value))


def float_from_json(x: Any) -> float:
    if isinstance(x, str) and x in ("nan", "inf", "-inf"):
        return float(x)
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    raise ManifestError(f"Expected a float in the manifest, found {x!r}.")


def scalar_from_json(type_name: str, value: Any) -> Any:
    if type_name == "none" and value is None:
        return None
    if type_name == "bool" and isinstance(value, bool):
        return value
    if type_name == "int" and isinstance(value, int) and not isinstance(value, bool):
        return value
    if type_name == "float":
        return float_from_json(value)
    if type_name == "complex" and isinstance(value, list) and len(value) == 2:
        return complex(float_from_json(value[0]), float_from_json(value[1]))
    if type_name == "str" and isinstance(value, str):
        return value
    raise ManifestError(f"Scalar of type {type_name!r} has an invalid value {value!r}.")


# --- parsing --------------------------------------------------------------------------


def _shape(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_RANK:
        raise ManifestError(f"Leaf {where!r}: shape must be a list of at most {MAX_RANK} ints, found {value!r}.")
    if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < MAX_ELEMENTS for d in value):
        raise ManifestError(f"Leaf {where!r}: shape {value!r} has a negative, huge or non-integer dimension.")
    if math.prod(value) >= MAX_ELEMENTS:
        raise ManifestError(f"Leaf {where!r}: shape {value!r} declares an absurd number of elements.")
    return tuple(value)


def _keys(value: Any, path: str) -> tuple:
    if not isinstance(value, list) or len(value) != len(path.split("/")) or not value:
        raise ManifestError(f"Leaf {path!r}: 'keys' must list one [kind, key] per path segment.")
    keys = []
    for entry in value:
        ok = isinstance(entry, list) and len(entry) in (2, 3) and entry[0] in KEY_KINDS
        if ok and entry[0] in ("seq", "index"):
            ok = isinstance(entry[1], int) and not isinstance(entry[1], bool) and entry[1] >= 0
        elif ok:
            ok = isinstance(entry[1], str) or (
                entry[0] == "dict" and isinstance(entry[1], int) and not isinstance(entry[1], bool)
            )
        if not ok or (len(entry) == 3 and entry[2] != "repr"):
            raise ManifestError(f"Leaf {path!r}: key entry {entry!r} is not [kind, key] with kind in {KEY_KINDS}.")
        keys.append(tuple(entry))
    if "/".join(map(record_segment, keys)) != path:
        raise ManifestError(f"Leaf {path!r}: its keys {value!r} do not spell its path.")
    return tuple(keys)


def _leaf(doc: Any) -> LeafRecord:
    if not isinstance(doc, dict):
        raise ManifestError(f"A manifest leaf must be an object, found {type(doc).__name__}.")
    path = validate_path(doc.get("path"))
    kind = doc.get("kind")
    if kind not in LEAF_KINDS:
        raise ManifestError(f"Leaf {path!r}: unknown kind {kind!r} (expected one of {LEAF_KINDS}).")
    keys = _keys(doc.get("keys"), path)
    if kind in ("array", "prng_key"):
        if doc.get("location") != path:
            raise ManifestError(f"Leaf {path!r}: its location {doc.get('location')!r} must equal its path.")
        dtype = doc.get("dtype")
        if not isinstance(dtype, str) or dtype not in STORED_DTYPES:
            raise ManifestError(f"Leaf {path!r}: unknown dtype {dtype!r}.")
        shape = _shape(doc.get("shape"), path)
        if kind == "array":
            if doc.get("array_type") not in ARRAY_TYPES:
                raise ManifestError(f"Leaf {path!r}: unknown array_type {doc.get('array_type')!r}.")
            return LeafRecord(path, keys, kind, shape, dtype, array_type=doc["array_type"])
        impl = doc.get("impl")
        if not isinstance(impl, str) or not impl.isidentifier():
            raise ManifestError(f"Leaf {path!r}: PRNG impl {impl!r} is not a name.")
        key_shape = _shape(doc.get("key_shape"), path)
        return LeafRecord(path, keys, kind, shape, dtype, impl=impl, value=key_shape)
    type_name = doc.get("type")
    if not isinstance(type_name, str) or len(type_name) > 1000:
        raise ManifestError(f"Leaf {path!r}: 'type' must be a string.")
    if kind == "scalar":
        if type_name not in SCALAR_TYPES:
            raise ManifestError(f"Leaf {path!r}: unknown scalar type {type_name!r}.")
        scalar_from_json(type_name, doc.get("value"))  # validates
        return LeafRecord(path, keys, kind, value=doc.get("value"), type_name=type_name)
    return LeafRecord(path, keys, kind, type_name=type_name)


def _check_containers(records: tuple[LeafRecord, ...], where: str, sequences_complete: bool) -> None:
    """Leaves must describe one tree: each container is of one kind, and no leaf is
    also a container of others."""
    kinds: dict[str, str] = {}
    indices: dict[str, set[int]] = {}
    leaves = {r.path for r in records}
    for record in records:
        parent = ""
        for kind, key, *_ in record.keys:
            family = "list" if kind in ("seq", "index") else "mapping"
            if kinds.setdefault(parent, family) != family or parent in leaves:
                raise ManifestError(
                    f"The manifest of {where} is inconsistent at {parent or '<root>'!r}: leaf {record.path!r} "
                    "disagrees with another leaf about what kind of container it is in."
                )
            if family == "list":
                indices.setdefault(parent, set()).add(key)
            parent = f"{parent}/{record_segment((kind, key, *_))}" if parent else record_segment((kind, key, *_))
    for parent, found in indices.items():
        # A sequence is rebuilt (like=None) with one slot per index, so its
        # indices must be exactly 0..n-1: no crafted index allocates a huge
        # list, and no lost leaf becomes a silent None. Manifests written before
        # empty subtrees were recorded have gaps there (None, (), optax's
        # EmptyState()), but only a few per leaf.
        if sequences_complete and max(found) != len(found) - 1:
            raise ManifestError(
                f"The manifest of {where} is inconsistent at {parent or '<root>'!r}: the sequence holds indices "
                f"{sorted(found)[:5]}{' ...' if len(found) > 5 else ''} (largest {max(found)}), not exactly "
                f"0..{len(found) - 1}: a leaf is missing from the manifest. The checkpoint is damaged or crafted."
            )
        if max(found) >= MAX_GAP_FACTOR * len(found) + MAX_GAP:
            raise ManifestError(
                f"The manifest of {where} is inconsistent at {parent or '<root>'!r}: a sequence with "
                f"{len(found)} leaves claims index {max(found)}. The manifest is corrupt or crafted."
            )


def parse_cost(raw: bytes) -> int:
    """An upper estimate of the memory Python's JSON parser takes for ``raw``.

    Counted on the raw bytes (fast; brackets and commas inside strings only
    make it larger): about 100 bytes per object or array, 60 per string and
    32 per other value. An eqxckpt manifest costs about 7-10x its size;
    ``[{},{},...]`` costs 25x, which is how a few MiB become GiB.
    """
    containers = raw.count(b"{") + raw.count(b"[")
    strings = raw.count(b'"') // 2
    values = raw.count(b",") + containers
    return 100 * containers + 60 * strings + 32 * max(0, values - strings) + len(raw)


def parse_manifest(raw: bytes, where: str = "checkpoint") -> Manifest:
    """Parse and validate manifest bytes; raises `ManifestError` on anything off.

    Memory stays within `MAX_PARSE_FACTOR` times the manifest's size (plus
    16 MiB): a denser document is refused before it is parsed.
    """
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"The manifest of {where} is {len(raw)} bytes, over the {MAX_MANIFEST_BYTES}-byte limit.")
    if parse_cost(raw) > MAX_PARSE_FACTOR * len(raw) + (16 << 20):
        raise ManifestError(
            f"The manifest of {where} is {len(raw)} bytes of densely packed JSON values (parsing it would take about "
            f"{parse_cost(raw) >> 20} MiB). eqxckpt never writes that: the manifest is corrupt or crafted."
        )
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ManifestError(
            f"The manifest of {where} is not valid JSON ({e}); the checkpoint is corrupt. "
            "Load an earlier checkpoint or restore this one from a copy."
        ) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ManifestError(f'{where} does not hold an eqxckpt manifest (no "format": "{FORMAT}").')
    version = doc.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ManifestError(f"The manifest of {where} has no integer format version.")
    if version != VERSION:
        raise ManifestError(
            f"{where} uses eqxckpt format version {version}; this eqxckpt reads version {VERSION}. "
            "Upgrade eqxckpt to read it."
        )
    metadata = doc.get("metadata", {})
    leaves = doc.get("leaves")
    if not isinstance(metadata, dict) or not isinstance(leaves, list):
        raise ManifestError(f"The manifest of {where} must have an object 'metadata' and a list 'leaves'.")
    records = tuple(_leaf(leaf) for leaf in leaves)
    paths = [r.path for r in records]
    if len(set(paths)) != len(paths):
        raise ManifestError(f"The manifest of {where} lists a leaf path twice.")
    complete = doc.get("sequences_complete", False)
    if not isinstance(complete, bool):
        raise ManifestError(f"The manifest of {where} has a non-boolean 'sequences_complete'.")
    _check_containers(records, where, complete)
    created = doc.get("created_unix", 0.0)
    save_id = doc.get("save_id", "")
    return Manifest(
        records,
        metadata,
        created if isinstance(created, (int, float)) else 0.0,
        save_id if isinstance(save_id, str) else "",
        complete,
    )


def read_manifest(location: Location) -> tuple[Manifest, "LocalPin | StorePin"]:
    """Read a committed checkpoint's manifest, or say exactly why there is none.

    Also returns what pins the checkpoint that manifest belongs to (see `_lease`),
    so a reader can tell afterwards whether it was replaced meanwhile.
    """
    if location.local is not None:
        local = location.local
        try:
            dir_fd = os.open(local, os.O_RDONLY | os.O_DIRECTORY)
        except NotADirectoryError:
            raise CheckpointNotFoundError(
                f"No checkpoint at {local}: it is a file, not a checkpoint directory."
            ) from None
        except FileNotFoundError:
            siblings = sorted(local.parent.iterdir()) if local.parent.is_dir() else []
            pending = [p for p in siblings if p.name.startswith(f".{local.name}.eqxckpt-tmp-")]
            if pending:
                raise IncompleteCheckpointError(
                    f"No checkpoint at {local}: a save to it is running or was interrupted before it committed "
                    f"(left {pending[0].name}). Load an earlier checkpoint."
                ) from None
            raise CheckpointNotFoundError(f"No checkpoint at {local}: the path does not exist.") from None
        except OSError as e:
            raise CheckpointNotFoundError(f"Cannot open {local}: {e.strerror or e}.") from None
        pin = LocalPin(local, dir_fd)
        try:
            return _read_local_manifest(local, dir_fd), pin
        except BaseException:
            pin.close()
            raise
    try:
        store = location.open_kvstore()
        result = _read_bounded(store, MANIFEST_NAME, MAX_MANIFEST_BYTES)
        if result.state == "value":
            return parse_manifest(bytes(result.value), str(location)), StorePin(location, result.stamp.generation)
        _, lease = read_lease(store)
        listed = store.list().result()
    except ValueError as e:
        if not is_storage_error(e):
            raise
        if str(e).startswith("NOT_FOUND"):
            raise CheckpointNotFoundError(
                f"No checkpoint at {location}: {reason(e)} (is the bucket's name right?)"
            ) from None
        raise CheckpointError(
            f"Cannot read {location}: {reason(e)}. Check the endpoint (AWS_ENDPOINT_URL), the network and the "
            "credentials."
        ) from None
    if lease is not None and not is_stale(lease) and lease.get("purpose") != "save":
        raise CheckpointNotFoundError(f"No checkpoint at {location}: it is being deleted ({describe_lease(lease)}).")
    if lease is not None and not is_stale(lease):
        raise IncompleteCheckpointError(
            f"No committed checkpoint at {location} right now: a save is writing it, or was killed less than "
            f"its lease's timeout ago ({describe_lease(lease)}). Load it again once that save has finished, or "
            "load an earlier checkpoint."
        )
    if listed:
        raise IncompleteCheckpointError(
            f"{location} has data but no {MANIFEST_NAME}: no save committed a checkpoint there (one was "
            "interrupted, or this is not an eqxckpt checkpoint). Load an earlier checkpoint, or save elsewhere."
        )
    raise CheckpointNotFoundError(f"No checkpoint at {location}.")


def _read_bounded(store: Any, key: str, cap: int) -> Any:
    """Read ``key``, downloading at most ``cap + 1`` bytes of it (then the caller refuses it).

    A ranged read past the end of a smaller value fails, so a small value
    (the usual case) is read again whole; a huge one is never downloaded.
    """
    try:
        return store.read(key, byte_range=slice(0, cap + 1)).result()
    except ValueError as e:
        if not str(e).startswith("OUT_OF_RANGE"):
            raise
    return store.read(key).result()


def _read_local_manifest(local: Any, dir_fd: int) -> Manifest:
    try:
        raw = read_capped(MANIFEST_NAME, MAX_MANIFEST_BYTES, dir_fd=dir_fd)  # a symlink could point anywhere
    except OSError as e:
        if e.errno != errno.ENOENT:
            raise ManifestError(
                f"Cannot read the manifest of {local}: {e.strerror or e} (a symlink or special file "
                "in place of eqxckpt.json is refused). The checkpoint is damaged or not trustworthy."
            ) from None
        raise IncompleteCheckpointError(
            f"{local} has no {MANIFEST_NAME}: the save that made it never committed "
            "(it was interrupted, or this is not an eqxckpt checkpoint). Load an earlier "
            "checkpoint, or save again to this path with overwrite=True."
        ) from None
    return parse_manifest(raw, str(local))
