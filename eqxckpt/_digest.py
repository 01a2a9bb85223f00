"""Leaf digests: XXH3-128 over what a stored leaf is and its bytes, so that unchanged
leaves can be told apart from changed ones without reading them, and `verify` can
check each leaf end to end (per-chunk checksums miss chunks swapped between leaves)."""

import json
import re
from typing import Any

import numpy as np
import xxhash

from ._dtypes import little_endian
from ._errors import ManifestError

ALGORITHM = "xxh3-128"
_FORMAT = re.compile(rf"{ALGORITHM}:[0-9a-f]{{32}}")


class LeafDigest:
    """A digest computed as a leaf's bytes arrive, in C order (row blocks, chunks of a
    slab, a packed leaf's bytes across batches): ``update`` each piece, then `value`."""

    def __init__(self, fields: list[Any]):
        self._hash = xxhash.xxh3_128()
        # What the bytes are, then a NUL: the same bytes as another dtype or shape differ.
        self._hash.update(json.dumps(fields, separators=(",", ":")).encode() + b"\0")

    def update(self, data: np.ndarray) -> None:
        """Add ``data``'s bytes as they are stored (`little_endian`), in C order."""
        self._hash.update(np.ascontiguousarray(little_endian(data)).reshape(-1).view(np.uint8).data)

    @property
    def value(self) -> str:
        """The digest as the manifest records it: ``xxh3-128:`` and 32 hex digits."""
        return f"{ALGORITHM}:{self._hash.hexdigest()}"


def digest(fields: list[Any], data: np.ndarray) -> str:
    """The digest of a leaf described by ``fields`` holding ``data`` (whole, in memory)."""
    leaf = LeafDigest(fields)
    leaf.update(data)
    return leaf.value


def parse_digest(value: Any, where: str) -> str | None:
    """A manifest's ``digest`` field: None when absent or made by an algorithm this
    version does not know (it cannot be checked, and is not an error); a malformed one
    of ours raises `ManifestError`."""
    if value is None or (isinstance(value, str) and not value.startswith(f"{ALGORITHM}:")):
        return None
    if not isinstance(value, str) or not _FORMAT.fullmatch(value):
        raise ManifestError(f"Leaf {where!r}: digest {value!r} is not {ALGORITHM}: and 32 lowercase hex digits.")
    return value
