"""The manifest, ``eqxckpt.json``: what a checkpoint holds, written last.

It is plain JSON a person can read. Everything read from it is validated before
use: types, paths (never outside the checkpoint), dtypes, shapes and sizes.
"""

import dataclasses
import json
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, cast

from crc32c import crc32c

from .._digest import ALGORITHM
from .._errors import ArgumentError, ManifestError
from .._gc import collector_paused
from .._leaf import Leaf, StoredLeaf, parse_leaf, with_storage
from .._paths import ARRAYS_PREFIX, PACKED_LOCATION, is_arrays_name
from .._process_state import ProcessStates
from .._version import __version__
from .._write._pack import PackedArray
from ._keys import check_containers, parse_keys
from ._table import LeafTable, encode_table, leaf_cell, parse_table

FORMAT = "eqxckpt"
# Version 2 adds packed leaves; version 3 the "arrays" prefix (object stores); version 4
# leaves whose arrays are in a sibling checkpoint's prefix (incremental saves on object
# stores); version 5 the leaves as a table of columns (`_table`), which every manifest
# is written with: no older eqxckpt reads it.
VERSION = 5
VERSIONS = (1, 2, 3, 4, 5)
# A manifest begins with the CRC-32C of its bytes (these 8 hex digits read as "00000000"),
# so that no flipped bit in a value goes unnoticed. Manifests written before begin with
# "format" and have none: still read (and older readers ignore the field).
CHECKSUM_HEAD = b'{"crc32c": "'
CHECKSUM_DIGITS = slice(len(CHECKSUM_HEAD), len(CHECKSUM_HEAD) + 8)
# 64 MiB hold the manifest of about a million small leaves (about 60 bytes each).
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
MAX_PARSE_FACTOR = 16
# json.dumps(..., allow_nan=False) builds an encoder per call; one serves every leaf.
_STRICT = json.JSONEncoder(allow_nan=False)


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What a checkpoint holds: its leaves in saved order, and the user's metadata."""

    # A tuple, or as read from a version-5 manifest a `LeafTable` (records made when asked for).
    leaves: Sequence[Leaf]
    metadata: dict[str, Any]
    created: float = dataclasses.field(default_factory=time.time)
    # Unique per save: two checkpoints written at one place never share a manifest's bytes.
    save_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    # Every sequence's empty subtrees are recorded (as None), so its indices are
    # exactly 0..n-1. False only for manifests written before that was so.
    sequences_complete: bool = True
    # Where the arrays are, relative to the manifest: "" (beside it), or on object
    # stores the save's own prefix ``%arrays.<hex>`` (see `_objects`).
    arrays: str = ""
    # Each process's own small state (`_process_state`), where the save was given them.
    process_states: ProcessStates | None = None

    def stored_paths(self) -> list[str]:
        """The paths of the checkpoint's arrays: each unpacked leaf's, and the packed array's."""
        stored = [leaf for leaf in self.leaves if isinstance(leaf, StoredLeaf)]
        packed = [PACKED_LOCATION] if any(leaf.offset is not None for leaf in stored) else []
        return [leaf.path for leaf in stored if leaf.offset is None] + packed

    def references(self) -> list[str]:
        """The sibling checkpoints' prefixes that some leaves' arrays are in, in order."""
        found = (leaf.arrays for leaf in self._unusual() if isinstance(leaf, StoredLeaf) and leaf.arrays is not None)
        return list(dict.fromkeys(found))

    def by_path(self) -> Mapping[str, Leaf]:
        """The leaves by path (as read from a version-5 manifest: each record made when
        first looked up)."""
        if isinstance(self.leaves, LeafTable):
            return self.leaves.by_path()
        return {leaf.path: leaf for leaf in self.leaves}

    def _unusual(self) -> Sequence[Leaf]:
        """The leaves that may have fields of their own (a sibling's ``arrays``): a leaf
        table's records parsed whole, or all of them."""
        return self.leaves.whole if isinstance(self.leaves, LeafTable) else self.leaves

    def leaf_cells(self) -> list[Any]:
        """Each leaf's entries of the leaf table (`_table.leaf_cell`), made once per leaf: a
        save makes them on its hashing thread while the chunks are written, and its commit
        only joins them."""
        with collector_paused():
            return [_cell(leaf) for leaf in self.leaves]

    def refuse_oversized(self, metadata_bytes: int) -> None:
        """Refuse (`ArgumentError`) to save what a load would refuse as too large: a manifest
        over `MAX_MANIFEST_BYTES`, with the digests its arrays will have. Bounded from above
        cheaply first (`_cell_bound`); only a tree near the limit is encoded to tell (and the
        commit's encoding is checked exactly, whatever this said). ``metadata_bytes``: the
        metadata's JSON size."""
        bound = metadata_bytes + 4096 + sum(map(_cell_bound, self.leaves))
        if bound <= MAX_MANIFEST_BYTES:
            return
        digested = tuple(
            with_storage(leaf, digest=_SOME_DIGEST) if isinstance(leaf, StoredLeaf) and leaf.digest is None else leaf
            for leaf in self.leaves
        )
        dataclasses.replace(self, leaves=digested).to_bytes()  # refuses what is too large

    @staticmethod
    def refuse_bytes(size: int, parse_cost: int = 0) -> None:
        """Refuse (`ArgumentError`) a manifest of ``size`` bytes that a load would refuse."""
        if size > MAX_MANIFEST_BYTES or parse_cost > MAX_PARSE_FACTOR * size + (16 << 20):
            why = (
                f"a load reads manifests of at most {MAX_MANIFEST_BYTES} bytes"
                if size > MAX_MANIFEST_BYTES
                else f"parsing it would take {parse_cost >> 20} MiB, more than a load allows for its size (deep "
                "nesting: each level of a key path costs JSON objects)"
            )
            raise ArgumentError(
                f"This save's manifest would be {size} bytes; {why}, so nothing is saved. Save fewer leaves (a list "
                "of many small arrays as one stacked array), shorter keys or shallower trees, less metadata, or "
                "long strings as uint8 arrays."
            )

    def to_bytes(self) -> bytes:
        head = {
            "format": FORMAT,
            "version": VERSION,
            "eqxckpt_version": __version__,
            "created_unix": self.created,
            "save_id": self.save_id,
            "sequences_complete": self.sequences_complete,
            **({"arrays": self.arrays} if self.arrays else {}),
            "metadata": self.metadata,
        }
        # One column per line: readable, with jq too.
        table = encode_table(self.leaf_cells())
        body = json.dumps(head, indent=1, allow_nan=False)[:-2]
        if self.process_states is not None:  # compact: indenting a nested state would multiply its size
            body += ',\n "process_states": ' + json.dumps(self.process_states.to_json(), separators=(",", ":"))
        raw = with_checksum((body + ',\n "leaves": ' + table + "\n}\n").encode())
        self.refuse_bytes(len(raw), parse_cost(raw))  # what a load would refuse is never committed
        return raw


# At most this many bytes of a leaf's entries in the leaf table besides its path, keys, shape
# and fields (its type's index, offset, digest, separators, a digest missing from its fields).
_CELL_BOUND = 100


def _cell_bound(leaf: Leaf) -> int:
    """At most the bytes a leaf takes in the leaf table: its path (safe characters only),
    its keys (compact, or as a list whose strings, escaped, take at most what their
    escaped path segments do, but for keys a hash shortened), its shape, its fields."""
    bound = _CELL_BOUND + 3 * len(leaf.path) + 12 * len(leaf.keys) + _json_bound(leaf)
    if "~" in leaf.path:  # a key longer than its segment
        bound += sum(12 * len(str(entry[1])) for entry in leaf.keys)
    if isinstance(leaf, StoredLeaf):
        bound += 24 * len(leaf.shape)
        if leaf.blocks is not None:
            bound += 48 * len(leaf.blocks) * len(leaf.data_shape)
        if leaf.seen is not None:
            bound += 100 + sum(len(generation) + 3 for generation in leaf.seen.generations)
        if leaf.arrays is not None:
            bound += 20 + len(leaf.arrays)
    return bound


_SOME_DIGEST = f"{ALGORITHM}:" + "0" * 32  # as many bytes as the one a leaf will have


def _json_bound(leaf: Leaf) -> int:
    """At most the bytes a scalar leaf's value takes in its line, as escaped JSON."""
    value = getattr(leaf, "json_value", None)
    bits = getattr(leaf, "bits", None)
    return _value_bound(value) + _value_bound(bits)


def _value_bound(value: Any) -> int:
    if isinstance(value, str):
        return 12 * len(value) + 2
    if isinstance(value, int):
        return value.bit_length() // 3 + 3
    if isinstance(value, (list, tuple)):
        return sum(_value_bound(v) + 2 for v in value) + 2
    return 32


# How deep a save's metadata may nest: far beyond any real use, far within what JSON's
# encoders and decoders take without running out of stack.
MAX_METADATA_DEPTH = 100


def metadata_bytes(metadata: Any) -> int:
    """The size of ``metadata`` (a save's) as JSON, or `ArgumentError` saying why it cannot
    be stored as it is: not a dict, not JSON (NaN, objects), keys that are not strings
    (JSON would turn ``1`` into ``"1"``, and two keys into one), nested deeper than
    `MAX_METADATA_DEPTH`."""
    if not isinstance(metadata, dict):
        raise ArgumentError(f"metadata must be a dict, got {type(metadata).__name__}.")
    pending: list[tuple[Any, int]] = [(metadata, 0)]
    while pending:  # no recursion: a deep nest is refused here, not by a RecursionError elsewhere
        value, depth = pending.pop()
        if depth > MAX_METADATA_DEPTH:
            raise ArgumentError(f"metadata is nested more than {MAX_METADATA_DEPTH} levels deep; flatten it.")
        if isinstance(value, dict):
            if bad := [key for key in value if not isinstance(key, str)]:
                raise ArgumentError(
                    f"metadata keys must be strings, got {bad[0]!r:.100}: JSON keeps no other, so it would come back "
                    "as a string, or collide with one."
                )
            pending.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, tuple):
            raise ArgumentError(
                f"metadata holds a tuple, {value!r:.100}: JSON would give it back as a list. Pass a list."
            )
        elif isinstance(value, list):
            pending.extend((v, depth + 1) for v in value)
    try:
        return len(json.dumps(metadata, allow_nan=False))
    except (TypeError, ValueError, RecursionError) as e:
        raise ArgumentError(f"metadata must be a JSON-serialisable dict: {type(e).__name__}: {e}") from None


def _cell(leaf: Leaf) -> Any:
    # Leaves are immutable, and `with_storage` (which makes a changed copy) drops it.
    cell = leaf.__dict__.get("_line")
    if cell is None:
        cell = leaf.__dict__["_line"] = leaf_cell(leaf.to_json())
    return cell


def with_checksum(raw: bytes) -> bytes:
    """The JSON object ``raw`` (without a ``crc32c``), with its checksum put first."""
    unsigned = CHECKSUM_HEAD + b'00000000",' + raw[1:]
    crc = crc32c(unsigned)
    return unsigned[: CHECKSUM_DIGITS.start] + b"%08x" % crc + unsigned[CHECKSUM_DIGITS.stop :]


def check_checksum(raw: bytes, doc: dict[str, Any], where: str) -> None:
    """Refuse (`ManifestError`) the manifest ``raw`` (parsed: ``doc``) if its bytes do not
    match its ``crc32c``. A manifest without one (written before there was one) passes if
    it begins with its ``"format"``, as every such manifest does: one whose checksum's name
    lost a bit does not pass for one written before."""
    stated = doc.get("crc32c")
    if stated is None:
        if doc.get("format") == FORMAT and next(iter(doc)) != "format":
            raise ManifestError(
                f"The manifest of {where} is damaged: it begins with {next(iter(doc))!r}, where eqxckpt writes "
                '"crc32c" (or, before manifests had a checksum, "format"). Load an earlier checkpoint or '
                "restore this one from a copy."
            )
        return
    head = CHECKSUM_HEAD + (stated.encode() if isinstance(stated, str) else b"")
    ok = isinstance(stated, str) and re.fullmatch("[0-9a-f]{8}", stated) is not None and raw.startswith(head)
    if not ok or crc32c(raw[: CHECKSUM_DIGITS.start] + b"00000000" + raw[CHECKSUM_DIGITS.stop :]) != int(stated, 16):
        raise ManifestError(
            f"The manifest of {where} is damaged (checksum mismatch): its bytes are not those its crc32c was "
            "computed over, so none of it is trusted. Load an earlier checkpoint or restore this one from a copy."
        )


# --- parsing --------------------------------------------------------------------------


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


def parse_json_object(raw: bytes, where: str, cap: int = MAX_MANIFEST_BYTES) -> dict[str, Any]:
    """``raw`` as a JSON object, refused (`ManifestError`) when over ``cap`` bytes, too densely
    packed to parse in bounded memory, not JSON, or not an object. For other formats' metadata."""
    if len(raw) > cap or parse_cost(raw) > MAX_PARSE_FACTOR * len(raw) + (16 << 20):
        raise ManifestError(
            f"{where} is too large or too densely packed to be what it claims; it is damaged or crafted."
        )
    try:
        doc = json.loads(raw, object_pairs_hook=_unique_keys)
    except _DuplicateKey as e:
        raise ManifestError(
            f"{where} names {e.args[0]!r} twice; readers disagree on which one counts, so it is refused."
        ) from None
    except (ValueError, RecursionError):
        raise ManifestError(f"{where} is not valid JSON; it is damaged.") from None
    if not isinstance(doc, dict):
        raise ManifestError(f"{where} is not a JSON object.")
    return doc


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    doc = dict(pairs)
    if len(doc) != len(pairs):
        seen: set[str] = set()
        raise _DuplicateKey(next(key for key, _ in pairs if key in seen or seen.add(key)))
    return doc


def parse_manifest(raw: bytes, where: str = "checkpoint") -> Manifest:
    """Parse and validate manifest bytes; raises `ManifestError` on anything off.

    Memory stays within `MAX_PARSE_FACTOR` times the manifest's size (plus
    16 MiB): a denser document is refused before it is parsed.
    """
    with collector_paused():  # a record per leaf, and no cycles among them
        return _parse_manifest(raw, where)


def _parse_manifest(raw: bytes, where: str) -> Manifest:
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"The manifest of {where} is {len(raw)} bytes, over the {MAX_MANIFEST_BYTES}-byte limit.")
    if parse_cost(raw) > MAX_PARSE_FACTOR * len(raw) + (16 << 20):
        raise ManifestError(
            f"The manifest of {where} is {len(raw)} bytes of densely packed JSON values (parsing it would take about "
            f"{parse_cost(raw) >> 20} MiB). eqxckpt never writes that: the manifest is corrupt or crafted."
        )
    try:
        doc = json.loads(raw)
    except ValueError as e:
        if "integer string conversion" in str(e):  # written where a raised limit let it be
            raise ManifestError(
                f"The manifest of {where} holds an int of more digits than this Python converts ({e}). Load it "
                "after raising the limit with sys.set_int_max_str_digits, as the process that saved it had."
            ) from None
        raise ManifestError(
            f"The manifest of {where} is not valid JSON ({e}); the checkpoint is corrupt. "
            "Load an earlier checkpoint or restore this one from a copy."
        ) from None
    except RecursionError as e:
        raise ManifestError(
            f"The manifest of {where} is not valid JSON ({e}); the checkpoint is corrupt. "
            "Load an earlier checkpoint or restore this one from a copy."
        ) from None
    if isinstance(doc, dict):
        check_checksum(raw, doc, where)  # before anything of it is trusted
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ManifestError(f'{where} does not hold an eqxckpt manifest (no "format": "{FORMAT}").')
    version = doc.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ManifestError(f"The manifest of {where} has no integer format version.")
    if version not in VERSIONS:
        raise ManifestError(
            f"{where} uses eqxckpt format version {version}; this eqxckpt reads versions {VERSIONS}. "
            "Upgrade eqxckpt to read it."
        )
    metadata = doc.get("metadata", {})
    leaves = doc.get("leaves")
    if not isinstance(metadata, dict) or not isinstance(leaves, dict if version == 5 else list):
        raise ManifestError(
            f"The manifest of {where} must have an object 'metadata' and its 'leaves' as "
            + ("a table (an object of columns)." if version == 5 else "a list.")
        )
    complete = doc.get("sequences_complete", False)
    if not isinstance(complete, bool):
        raise ManifestError(f"The manifest of {where} has a non-boolean 'sequences_complete'.")
    records: Sequence[Leaf]
    if version == 5:  # every column and the tree they make checked
        records = table = parse_table(leaves, where, complete)
        # Only records parsed whole (with fields of their own) name a sibling's arrays.
        unusual = table.whole
        packed_arrays: set[str | None] = {None} if table.plain_packed else set()
    else:
        records = unusual = _parse_rows(cast(list[Any], leaves), where, complete)
        packed_arrays = set()
    if version == 1 and any(isinstance(r, StoredLeaf) and r.offset is not None for r in records):
        raise ManifestError(f"The manifest of {where} is version 1 but has packed leaves; it is corrupt or crafted.")
    arrays = doc.get("arrays", "")
    if (version in (3, 4) and not arrays) or (version < 3 and arrays) or (arrays and not is_arrays_name(arrays)):
        raise ManifestError(
            f"The manifest of {where} has version {version} and arrays {arrays!r}: versions 3 and 4 name where "
            f"its arrays are ({ARRAYS_PREFIX}<32 hex digits>), earlier versions do not. It is corrupt or crafted."
        )
    packed_arrays.update(r.arrays for r in unusual if isinstance(r, StoredLeaf) and r.offset is not None)
    if len(packed_arrays) > 1:
        raise ManifestError(
            f"The manifest of {where} has packed leaves in different arrays: they share one packed array, "
            "so all name the same prefix or none does. It is corrupt or crafted."
        )
    referring = any(isinstance(r, StoredLeaf) and r.arrays is not None for r in unusual)
    if (referring and not arrays) if version == 5 else referring != (version == 4):
        raise ManifestError(
            f"The manifest of {where} has version {version}"
            + (" and leaves in another checkpoint's arrays" if referring else " but no leaf in another checkpoint")
            + ": only version 4 has such leaves, and each version-4 manifest has one; in version 5 only a "
            "manifest with 'arrays' has them. It is corrupt or crafted."
        )
    created = doc.get("created_unix", 0.0)
    save_id = doc.get("save_id", "")
    states = doc.get("process_states")
    process_states = None if states is None else ProcessStates.from_json(states, where)
    return Manifest(
        records,
        metadata,
        created if isinstance(created, (int, float)) else 0.0,
        save_id if isinstance(save_id, str) else "",
        complete,
        arrays,
        process_states,
    )


def _parse_rows(leaves: list[Any], where: str, complete: bool) -> tuple[Leaf, ...]:
    """The leaves of a manifest written before version 5: a record per leaf."""
    records = tuple(parse_leaf(leaf, parse_keys) for leaf in leaves)
    paths = [r.path for r in records]
    if len(set(paths)) != len(paths):
        raise ManifestError(f"The manifest of {where} lists a leaf path twice.")
    if any(path.split("/")[0] == PACKED_LOCATION for path in paths):
        raise ManifestError(f"The manifest of {where} names a leaf {PACKED_LOCATION!r}, which no key can be.")
    if (packing := PackedArray.of(records)) is not None:
        packing.check_ranges(where)
    check_containers(records, where, complete)
    return records
