"""Leaf digests: XXH3-128 over what a stored leaf is and its bytes, so that unchanged
leaves can be told apart from changed ones without reading them, and `verify` can
check each leaf end to end (per-chunk checksums miss chunks swapped between leaves)."""

import json
import math
import re
from typing import Any

import numpy as np
import xxhash

from ._dtypes import little_endian
from ._errors import ManifestError
from ._window import host_memory_budget

ALGORITHM = "xxh3-128"
_FORMAT = re.compile(rf"{ALGORITHM}:[0-9a-f]{{32}}")
# json.dumps(..., separators=(",", ":")) builds an encoder per call; one serves every leaf.
_COMPACT = json.JSONEncoder(separators=(",", ":"))
# The hash of each description seen, before any bytes: many leaves share a dtype and
# shape, and a copy of a started hash costs less than encoding the description again.
# Keyed by repr, which tells True from 1 and 1.0 (json would write them apart, too).
_STARTED: dict[str, Any] = {}
_MAX_STARTED = 1 << 12


def _plain(name: Any) -> bool:
    """Whether ``name`` is written in JSON as itself between quotes (nothing escaped)."""
    return type(name) is str and name.isascii() and name.isidentifier()


def _started(fields: list[Any]) -> Any:
    """A new XXH3-128 hash that has taken ``fields``' description: its compact JSON, then a NUL."""
    if len(fields) == 3 and _plain(fields[0]) and _plain(fields[1]) and type(fields[2]) is list:
        shape = fields[2]
        if all(type(d) is int for d in shape):
            # A kind, a dtype and a shape of plain ints, as every array leaf has: the same
            # bytes as the encoder's, written directly (most shapes are seen once).
            return xxhash.xxh3_128(f'["{fields[0]}","{fields[1]}",[{",".join(map(str, shape))}]]\0'.encode())
    key = repr(fields)
    started = _STARTED.get(key)
    if started is None:
        # What the bytes are, then a NUL: the same bytes as another dtype or shape differ.
        started = xxhash.xxh3_128(_COMPACT.encode(fields).encode() + b"\0")
        if len(_STARTED) >= _MAX_STARTED:
            _STARTED.clear()
        _STARTED[key] = started
    return started.copy()


class LeafDigest:
    """A digest computed as a leaf's bytes arrive, in C order (row blocks, chunks of a
    slab, a packed leaf's bytes across batches): ``update`` each piece, then `value`.

    A part's leaf (``blocks``: how many blocks it holds) is digested block by block: each
    block's bytes in C order on their own, then the blocks' hashes in the manifest's
    order, so its blocks may be read in any order, or band by band side by side."""

    def __init__(self, fields: list[Any], blocks: int | None = None):
        self._hash = _started(fields)
        self._blocks = None if blocks is None else [xxhash.xxh3_128() for _ in range(blocks)]

    def update(self, data: "np.ndarray | Tiled", block: int = 0) -> None:
        """Add ``data``'s bytes as they are stored (`little_endian`), in C order (of block
        ``block``, for a part's leaf): an array's, or the rows that blocks tile (`Tiled`)."""
        hashing = self._hash if self._blocks is None else self._blocks[block]
        if isinstance(data, Tiled):
            data.update(hashing)
        else:
            hashing.update(_stored_bytes(data))

    def update_raw(self, raw: np.ndarray, block: int = 0) -> None:
        """Add bytes exactly as a chunk file holds them (``raw``: a C-contiguous ``uint8``
        array, as `verify` reads them): no dtype, so nothing to convert."""
        (self._hash if self._blocks is None else self._blocks[block]).update(raw.data)

    @property
    def value(self) -> str:
        """The digest as the manifest records it: ``xxh3-128:`` and 32 hex digits."""
        if self._blocks is None:
            return f"{ALGORITHM}:{self._hash.hexdigest()}"
        whole = self._hash.copy()
        for block in self._blocks:
            whole.update(block.digest())
        return f"{ALGORITHM}:{whole.hexdigest()}"


def _stored_bytes(data: np.ndarray) -> Any:
    """``data``'s bytes as stored (`little_endian`), in C order, as a buffer."""
    data = little_endian(data)
    if not data.flags.c_contiguous:
        data = np.ascontiguousarray(data)
    return data.reshape(-1).view(np.uint8).data


# A tiled leaf is digested a band of rows at a time, copied together in C order.
TILED_BAND_BYTES = 8 << 20


class Tiled:
    """A leaf held as blocks that tile it (a sharded array whose every shard this process
    holds): ``blocks`` pairs each block, ``((start, stop), ...)`` per dimension, with its
    data. Its digest is the whole leaf's, in C order (`digest`)."""

    def __init__(self, shape: tuple[int, ...], blocks: list[tuple[tuple[tuple[int, int], ...], np.ndarray]]):
        self.shape, self.blocks = shape, sorted(blocks, key=lambda pair: pair[0])

    @staticmethod
    def tiles(shape: tuple[int, ...], blocks: list[tuple[tuple[int, int], ...]]) -> bool:
        """Whether ``blocks`` cover ``shape`` exactly, each element once, in bands of rows
        (blocks that share their rows), as a sharding's blocks do."""
        if not blocks or len(set(blocks)) != len(blocks) or any(len(b) != len(shape) for b in blocks):
            return False
        if not all(0 <= a < b <= n for block in blocks for (a, b), n in zip(block, shape)):
            return bool(not shape and blocks == [()])
        rows = sorted({block[0] for block in blocks})
        if rows[0][0] != 0 or rows[-1][1] != shape[0] or any(a[1] != b[0] for a, b in zip(rows, rows[1:])):
            return False

        def overlap(x: tuple[tuple[int, int], ...], y: tuple[tuple[int, int], ...]) -> bool:
            return all(a < d and c < b for (a, b), (c, d) in zip(x, y))

        if any(overlap(x, y) for i, x in enumerate(blocks) for y in blocks[i + 1 :] if x[0] == y[0]):
            return False
        return sum(math.prod(b - a for a, b in block) for block in blocks) == math.prod(shape)

    def update(self, hashing: Any) -> None:
        """Feed ``hashing`` the leaf's bytes as stored, in C order: a band of rows (of the
        blocks starting at the same row) at a time, assembled in one buffer of at most
        `TILED_BAND_BYTES` and the host memory budget; a row over that, a part of it at a time."""
        if not self.shape:
            hashing.update(_stored_bytes(self.blocks[0][1]))
            return
        dtype = self.blocks[0][1].dtype
        row = max(1, math.prod(self.shape[1:]) * dtype.itemsize)
        bands: dict[tuple[int, int], list[tuple[tuple[tuple[int, int], ...], np.ndarray]]] = {}
        for block, data in self.blocks:
            bands.setdefault(block[0], []).append((block, data))
        limit = max(1, min(TILED_BAND_BYTES, host_memory_budget()))
        if row > limit and self.shape[1:]:
            # One row alone is over the budget: its blocks' rows tile the rest of the leaf,
            # hashed the same way, a part of the row at a time.
            for (start, stop), members in sorted(bands.items()):
                for index in range(start, stop):
                    Tiled(self.shape[1:], [(block[1:], data[index - start]) for block, data in members]).update(hashing)
            return
        # One buffer for every band, so that no two are held at once.
        step = max(1, limit // row)
        whole = np.empty((min(step, self.shape[0]), *self.shape[1:]), dtype)
        for (start, stop), members in sorted(bands.items()):
            for first in range(start, stop, step):
                last = min(stop, first + step)
                buffer = whole[: last - first]
                for block, data in members:
                    buffer[(slice(None), *(slice(a, b) for a, b in block[1:]))] = data[first - start : last - start]
                hashing.update(_stored_bytes(buffer))


def digest(fields: list[Any], data: "np.ndarray | list[np.ndarray] | Tiled") -> str:
    """The digest of a leaf described by ``fields`` holding ``data`` (whole, in memory; as
    blocks that tile it, `Tiled`; or, for a part's leaf, a list of the blocks it holds, in
    order): what a `LeafDigest` given the same gives, in one step (a save digests every leaf)."""
    if isinstance(data, Tiled):
        hashed = _started(fields)
        data.update(hashed)
        return f"{ALGORITHM}:{hashed.hexdigest()}"
    if isinstance(data, list):
        hashing = LeafDigest(fields, len(data))
        for block, piece in enumerate(data):
            hashing.update(piece, block)
        return hashing.value
    hashed = _started(fields)
    hashed.update(_stored_bytes(data))
    return f"{ALGORITHM}:{hashed.hexdigest()}"


def parse_digest(value: Any, where: str) -> str | None:
    """A manifest's ``digest`` field: None when absent or made by an algorithm this
    version does not know (it cannot be checked, and is not an error); a malformed one
    of ours raises `ManifestError`."""
    if value is None or (isinstance(value, str) and not value.startswith(f"{ALGORITHM}:")):
        return None
    if not isinstance(value, str) or not _FORMAT.fullmatch(value):
        raise ManifestError(f"Leaf {where!r}: digest {value!r} is not {ALGORITHM}: and 32 lowercase hex digits.")
    return value
