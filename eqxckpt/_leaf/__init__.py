"""Leaf kinds: what one leaf of a checkpoint is, and how each kind is saved,
written into the manifest, checked against `like`, and restored. The kinds (each
class's docstring says what it stores): `ArrayLeaf` and `KeyLeaf`, the
`StoredLeaf`s; `ScalarLeaf`, whose value is in the manifest; `OpaqueLeaf`, whose
value `load` takes from `like`. A new kind is one class in a module of its own here, registered in `KINDS`.
"""

from typing import Any

from .._errors import ManifestError
from .._paths import validate_path
from ._array import ArrayLeaf as ArrayLeaf, check_bool_bytes as check_bool_bytes, refuse_narrowing as refuse_narrowing
from ._base import (
    ARRAY_TYPES as ARRAY_TYPES,
    MAX_BLOCKS as MAX_BLOCKS,
    MAX_ELEMENTS as MAX_ELEMENTS,
    MAX_RANK as MAX_RANK,
    SCALAR_NAMES as SCALAR_NAMES,
    UNKNOWN as UNKNOWN,
    KeyRecord as KeyRecord,
    Leaf as Leaf,
    Seen as Seen,
    StoredLeaf as StoredLeaf,
    check_blocks as check_blocks,
    listed_blocks as listed_blocks,
    parse_blocks as parse_blocks,
    parse_shape as parse_shape,
    shape_refusal as shape_refusal,
    with_storage as with_storage,
)
from ._key import KeyLeaf as KeyLeaf, data_shape_refusal as data_shape_refusal, key_dtype as key_dtype
from ._value import OpaqueLeaf as OpaqueLeaf, ScalarLeaf as ScalarLeaf

KINDS: dict[str, type[Leaf]] = {cls.kind: cls for cls in (ArrayLeaf, KeyLeaf, ScalarLeaf, OpaqueLeaf)}


def parse_leaf(doc: Any, keys_of: Any) -> Leaf:
    """One manifest entry as its kind's `Leaf`; ``keys_of(value, path)`` validates its keys."""
    if not isinstance(doc, dict):
        raise ManifestError(f"A manifest leaf must be an object, found {type(doc).__name__}.")
    path = validate_path(doc.get("path"))
    kind = doc.get("kind")
    if not isinstance(kind, str) or kind not in KINDS:
        raise ManifestError(f"Leaf {path!r}: unknown kind {kind!r} (expected one of {tuple(KINDS)}).")
    return KINDS[kind].from_json(doc, path, keys_of(doc.get("keys"), path))
