"""The leaf table: a manifest's leaves as columns (format version 5).

A leaf's record (`Leaf.to_json`, one owner per kind) is split into what every leaf has,
one column each (its path, compact keys, shape, packed offset, digest), what many leaves
share, kept once in ``types`` and named per leaf by its index there (kind, dtype, array
type, a PRNG implementation), and the rest, few leaves' (a scalar's value, a part's
blocks, a shared array's prefix), kept per leaf in ``fields``. A reader puts the record
back together; for the leaves without ``fields`` it checks the columns with numpy and a
few passes over whole columns, and makes each record from its type's, which the kind's
own parser made. So a manifest of a million small leaves is about 60 bytes and 1-2 µs of
parsing per leaf, where a record per leaf was about 260 bytes and 17 µs.
"""

import base64
import binascii
import functools
import itertools
import json
import math
import operator
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import numpy as np

from .._digest import ALGORITHM
from .._errors import ManifestError
from .._gc import collector_paused
from .._leaf import KINDS, MAX_ELEMENTS, MAX_RANK, Leaf, data_shape_refusal, parse_leaf, parse_shape, shape_refusal
from .._paths import MAX_SEGMENT, PACK_ALIGNMENT, PACKED_LOCATION, validate_paths
from .._write._pack import PackedArray
from ._keys import check_tree, compact_entry, compact_keys, compact_keys_of, compact_kinds, compact_prefix, parse_keys

# Each column holds one entry per leaf, in the tree's flattening order.
COLUMNS = ("paths", "keys", "type", "shapes", "offsets")
DIGESTS = ALGORITHM  # the column of digests: base64 of 16 bytes per leaf that has one
# The fields of a record that many leaves share: kept once, in "types".
TYPE_FIELDS = ("kind", "dtype", "array_type", "impl", "key_shape", "type", "name")
# What a leaf's "fields" may not hold: what a column or its type says.
_NOT_FIELDS = frozenset(("path", "keys", "shape", "location", "offset", *TYPE_FIELDS))
_TYPE_NAMES = frozenset(TYPE_FIELDS)
_DIGEST_HEX = re.compile(rf"{ALGORITHM}:([0-9a-f]{{32}})")
_DIGEST_BYTES = 16
_STRICT = json.JSONEncoder(allow_nan=False, separators=(",", ":"))


# --- writing --------------------------------------------------------------------------

Cell = tuple[Any, Any, str, dict[str, Any], Any, Any, bytes | None, dict[str, Any] | None]


def leaf_cell(row: dict[str, Any]) -> Cell:
    """A leaf's record (``Leaf.to_json``, or any dict a test crafts) split into its
    columns' entries: path, keys (compact where its path spells them), its type's key and
    fields, shape, packed offset, digest bytes, and its other fields (None: none)."""
    path, keys = row.get("path"), row.get("keys")
    if type(keys) is list and type(path) is str and all(type(entry) is list for entry in keys):
        keys = compact_keys_of(keys, path) or keys
    type_fields, other = {}, {}
    for name, value in row.items():  # (one pass: a save makes a cell of every leaf)
        if name in _TYPE_NAMES:
            type_fields[name] = value
        elif name not in _NOT_FIELDS:
            other[name] = value
    kind_name = row.get("kind")
    kind = KINDS.get(kind_name) if isinstance(kind_name, str) else None
    stored = kind is not None and kind.stored
    offset = None
    location = row.get("location")
    if location == PACKED_LOCATION and type(row.get("offset")) is int:
        offset = row["offset"]
    elif not (location == path and "offset" not in row):
        # No column says that (a test's crafted record): kept for the reader to refuse.
        other.update({name: row[name] for name in ("location", "offset") if name in row})
    digest = None
    if stored:
        digest_text = other.get("digest")
        match = _DIGEST_HEX.fullmatch(digest_text) if isinstance(digest_text, str) else None
        if match is not None:
            digest = bytes.fromhex(match[1])
            del other["digest"]
        elif "digest" not in other:
            other["digest"] = None  # a stored leaf without one says so: its digest is not in the column
    # (str: Python's own text of the fields, which tells types apart; made in C, unlike JSON's)
    return path, keys, str(type_fields), type_fields, row.get("shape"), offset, digest, other or None


def encode_table(cells: Iterable[Cell]) -> str:
    """The leaf table of ``cells`` (`leaf_cell`'s, in the leaves' order) as the JSON of
    the manifest's ``leaves``: one column a line, so that it stays readable.

    **Arguments:**

    - `cells`: each leaf's, in order.

    **Returns:** a JSON object, as text.

    ```python
    encode_table(leaf_cell(leaf.to_json()) for leaf in leaves)
    ```
    """
    columns = table_of(cells)
    lines = (f"  {json.dumps(name)}: {_STRICT.encode(value)}" for name, value in columns.items())
    return "{\n" + ",\n".join(lines) + "\n }"


def table_of(cells: Iterable[Cell]) -> dict[str, Any]:
    """The leaf table of ``cells`` (`leaf_cell`'s, in the leaves' order), as a dict of
    its columns (`encode_table` writes it)."""
    types: dict[str, int] = {}
    type_docs: list[dict[str, Any]] = []
    paths, keys, type_column, shapes, offsets, digests = [], [], [], [], [], []
    fields: dict[str, Any] = {}
    for i, (path, key, type_key, type_fields, shape, offset, digest, other) in enumerate(cells):
        index = types.get(type_key)
        if index is None:
            index = types[type_key] = len(type_docs)
            type_docs.append(type_fields)
        paths.append(path)
        keys.append(key)
        type_column.append(index)
        shapes.append(shape)
        offsets.append(offset)
        if digest is not None:
            digests.append(digest)
        if other is not None:
            fields[str(i)] = other
    columns = {"count": len(paths), "types": type_docs}
    columns.update(zip(COLUMNS, (paths, keys, type_column, shapes, offsets)))
    columns[DIGESTS] = base64.b64encode(b"".join(digests)).decode()
    columns["fields"] = fields
    return columns


def table_rows(table: Any) -> list[dict[str, Any]]:
    """The leaf records a leaf table holds, put back together as a version-4 manifest
    lists them (unchecked: for tools and tests that edit records; `parse_table` is the
    reader).

    **Arguments:**

    - `table`: a manifest's ``leaves`` (version 5), as parsed from JSON.

    **Returns:** a list of records (dicts), in order.

    ```python
    rows = table_rows(json.loads(raw)["leaves"])
    ```
    """
    digests = iter(_digest_strings(base64.b64decode(table[DIGESTS])))
    rows = []
    for i in range(table["count"]):
        type_doc = table["types"][table["type"][i]]
        other = table["fields"].get(str(i), {})
        digest = next(digests) if _is_stored(type_doc) and "digest" not in other else None
        keys = table["keys"][i]
        if isinstance(keys, str):
            keys = [list(entry) for entry in parse_keys(keys, table["paths"][i])]
        rows.append(_row(table["paths"][i], keys, type_doc, table["shapes"][i], table["offsets"][i], digest, other))
    return rows


def _row(
    path: Any, keys: Any, type_doc: dict[str, Any], shape: Any, offset: Any, digest: str | None, other: dict[str, Any]
) -> dict[str, Any]:
    """A leaf's record from its entries of the table's columns, its type and its fields."""
    row = {"path": path, "keys": keys, **type_doc}
    if shape is not None:
        row["shape"] = shape
    if offset is not None:
        row.update(location=PACKED_LOCATION, offset=offset)
    elif _is_stored(type_doc):
        row["location"] = path
    if digest is not None:
        row["digest"] = digest
    row.update(other)
    if "digest" in row and row["digest"] is None:  # a stored leaf without one: as its record has none
        del row["digest"]
    return row


def _is_stored(type_doc: dict[str, Any]) -> bool:
    kind = type_doc.get("kind")
    return isinstance(kind, str) and kind in KINDS and KINDS[kind].stored


def _digest_strings(raw: bytes) -> list[str]:
    hexes = raw.hex()
    return [_digest(hexes, at) for at in range(len(raw) // _DIGEST_BYTES)]


def _digest(hexes: str, at: int) -> str:
    """The ``at``-th digest of the column (as hex), as a record writes it."""
    return f"{ALGORITHM}:{hexes[32 * at : 32 * at + 32]}"


# --- reading --------------------------------------------------------------------------


def parse_table(table: Any, where: str, sequences_complete: bool) -> "LeafTable":
    """The leaves of a manifest's leaf table, every column checked; `ManifestError`
    naming the first leaf (or column) that is not what eqxckpt writes.

    **Arguments:**

    - `table`: the manifest's ``leaves`` (version 5), as parsed from JSON.
    - `where`: the checkpoint, as errors name it.
    - `sequences_complete`: the manifest's (see `check_tree`).

    **Returns:** the leaves in order (a `LeafTable`): each what `parse_leaf` makes of its
    record, made when first asked for.

    ```python
    parse_table(json.loads(raw)["leaves"], "ckpt", True)
    ```
    """
    if not isinstance(table, dict):
        raise ManifestError(f"The manifest of {where} must hold its leaves as a table (an object of columns).")
    count = table.get("count")
    if type(count) is not int or count < 0:
        raise ManifestError(f"The manifest of {where} has no leaf count.")
    columns: list[Any] = [table.get(name) for name in COLUMNS]
    for name, column in zip(COLUMNS, columns):
        if type(column) is not list or len(column) != count:
            found = len(column) if isinstance(column, list) else type(column).__name__
            raise ManifestError(
                f"The manifest of {where}: its {name!r} column must list one entry for each of its {count} leaves, "
                f"found {found}. It is corrupt or crafted."
            )
    paths, keys, type_column, shapes, offsets = columns
    unique, parents = _check_paths(paths, where)
    makers = _types(table.get("types"), count, where)
    if not set(map(type, type_column)) <= {int} or (
        count and not 0 <= min(type_column) <= max(type_column) < len(makers)
    ):
        raise ManifestError(f"The manifest of {where}: its 'type' column must hold indices into its 'types'.")
    fields = _fields(table.get("fields"), paths, where)
    types = np.asarray(type_column, np.intp)
    stored = np.array([maker.stored for maker in makers] + [False], bool)[types]
    plain = np.array([maker.leaf is not None for maker in makers] + [False], bool)[types]
    plain &= np.fromiter(map(isinstance, keys, itertools.repeat(str)), bool, count)  # else parsed whole
    for unknown in np.flatnonzero(~np.array([maker.known for maker in makers] + [True], bool)[types])[:1].tolist():
        kind = makers[type_column[unknown]].doc.get("kind")
        raise ManifestError(f"Leaf {paths[unknown]!r}: unknown kind {kind!r} (expected one of {tuple(KINDS)}).")
    packed = _check_unstored(paths, shapes, offsets, stored, where)
    digested = stored.copy()
    for index, other in fields.items():
        plain[index] = False
        if "digest" in other:
            digested[index] = False
    hexes = _digests(table.get(DIGESTS), int(digested.sum()), where)
    digest_at = (np.cumsum(digested) - 1).tolist()
    elements = _check_shapes(paths, shapes, stored, where)
    for i in np.flatnonzero(np.array([bool(m.key_shape) for m in makers] + [False], bool)[types]).tolist():
        # A key array's data has the keys' dimensions and each key's: checked together, as its kind does.
        if why := data_shape_refusal(tuple(shapes[i]), makers[type_column[i]].key_shape):
            raise ManifestError(f"Leaf {paths[i]!r}: its key data's shape {why}.")
    # Bytes per element, capped where no leaf of the type fits a packed array (int64 holds them).
    units = np.array([min(maker.unit_bytes, MAX_ELEMENTS + 1) for maker in makers] + [0], np.int64)[types]
    _check_offsets(paths, offsets, packed, elements, units, where)
    branches = _check_compact_keys(paths, keys, parents, plain, where)
    made: list[Leaf | None] = [None] * count
    odd: list[tuple[str, str]] = []
    for i in np.flatnonzero(~plain).tolist():
        digest = _digest(hexes, digest_at[i]) if digested[i] else None
        row = _row(paths[i], keys[i], makers[type_column[i]].doc, shapes[i], offsets[i], digest, fields.get(i, {}))
        made[i] = record = parse_leaf(row, parse_keys)
        odd.append((compact_kinds(record.keys), parents[i]))
    branches.update(odd)
    check_tree(paths, unique, parents, branches, where, sequences_complete)
    plain_packed = bool((packed & plain).any())
    return LeafTable(made, paths, keys, type_column, shapes, offsets, hexes, digest_at, makers, plain_packed)


class LeafTable(Sequence[Leaf]):
    """A manifest's leaves (format version 5): every column checked when it was parsed,
    each leaf's record made when first asked for (a load of a few leaves of a million
    makes a few). A sequence of `Leaf`s like a tuple, equal to one with the same records.

    ```python
    leaves = eqxckpt.open("ckpt").stored.manifest.leaves
    leaves[0].path
    ```
    """

    def __init__(
        self,
        made: list[Leaf | None],
        paths: list[str],
        keys: list[Any],
        type_column: list[int],
        shapes: list[Any],
        offsets: list[Any],
        hexes: str,
        digest_at: list[int],
        makers: list["_Type"],
        plain_packed: bool,
    ):
        # Those parsed whole: with fields of their own (a sibling's arrays, a part's blocks, ...).
        self.whole = tuple(leaf for leaf in made if leaf is not None)
        self.plain_packed = plain_packed  # whether a packed leaf is not among them
        self._made = made
        self._columns = (paths, keys, type_column, shapes, offsets, digest_at)
        self._hexes = hexes
        self._makers = makers
        self._complete = None not in made

    def __len__(self) -> int:
        return len(self._made)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        leaf = self._made[index]
        if leaf is None:
            i = index % len(self)
            leaf = self._made[i] = self._make(i, i + 1)[0]
        return leaf

    def __iter__(self) -> Iterator[Leaf]:
        if not self._complete:
            with collector_paused():  # a few objects per leaf, none in a cycle
                made = self._made
                for i, leaf in enumerate(self._make(0, len(made))):
                    if made[i] is None:
                        made[i] = leaf
            self._complete = True
        return iter(cast(list[Leaf], self._made))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    def by_path(self) -> "LeafIndex":
        """The leaves by path, each record made when first asked for."""
        return LeafIndex(self, dict(zip(self._columns[0], range(len(self)))))

    def __repr__(self) -> str:
        return f"LeafTable({len(self)} leaves)"

    def _make(self, start: int, stop: int) -> list[Leaf | None]:
        """The records of leaves ``start:stop`` not yet made (None for the others): what
        `parse_leaf` makes of each one's record (`_Type.make`)."""
        paths, keys, type_column, shapes, offsets, digest_at = self._columns
        makers, hexes, made = self._makers, self._hexes, self._made
        out: list[Leaf | None] = []
        for i in range(start, stop):
            if made[i] is not None:
                out.append(None)
                continue
            path = paths[i]
            maker = makers[type_column[i]]
            leaf_keys = compact_keys(keys[i], path)
            assert leaf_keys is not None  # checked with the table
            if maker.stored:  # a stored leaf without fields has its digest in the column
                leaf = maker.make(path, leaf_keys, tuple(shapes[i]), offsets[i], _digest(hexes, digest_at[i]))
                leaf.__dict__["_nbytes"] = math.prod(shapes[i]) * maker.unit_bytes  # (what `nbytes` keeps)
                out.append(leaf)
            else:
                out.append(maker.make(path, leaf_keys, None, None, None))
        return out


class LeafIndex(Mapping[str, Leaf]):
    """A `LeafTable`'s leaves by path: looking one up makes only its record.

    ```python
    eqxckpt.open("ckpt").stored.records["model/w"]
    ```
    """

    def __init__(self, table: LeafTable, index: dict[str, int]):
        self._table = table
        self._index = index

    def __getitem__(self, path: str) -> Leaf:
        return self._table[self._index[path]]

    def __contains__(self, path: object) -> bool:
        return path in self._index

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def values(self) -> Any:
        return list(self._table)  # every record, made in one pass

    def items(self) -> Any:
        return list(zip(self._index, self._table))


class _Type:
    """One entry of ``types``: its fields, whether its leaves are stored arrays, and
    (where its fields make a record with only the columns' help) the record of a leaf of
    it, made by its kind's parser, that its leaves are copies of."""

    def __init__(self, doc: dict[str, Any]):
        self.doc = doc
        self.stored = _is_stored(doc)
        self.known = isinstance(doc.get("kind"), str) and doc["kind"] in KINDS
        self.leaf: Leaf | None = None
        self.unit_bytes = 0
        self.key_shape: tuple[int, ...] = ()  # a key array's each key's data
        sample = {**doc, "path": "p", "keys": [["dict", "p"]]}
        if self.stored:
            sample.update(shape=[], location="p")
        try:
            self.leaf = parse_leaf(sample, parse_keys)
        except ManifestError:
            pass  # its leaves' records are parsed whole, and say what is wrong
        if self.leaf is not None:
            self._fields = {k: v for k, v in self.leaf.__dict__.items() if not k.startswith("_")}
            self._cls = type(self.leaf)
            self.unit_bytes = self.leaf.nbytes if self.stored else 0  # of a shape-() leaf: one element's
            self.key_shape = getattr(self.leaf, "key_shape", ())

    def make(self, path: str, keys: Any, shape: Any, offset: int | None, digest: str | None) -> Leaf:
        """The record of a leaf of this type: what its kind's parser makes of the same
        record, whose other fields it checked once for all of them."""
        leaf = object.__new__(self._cls)
        if self.stored:
            fields = {**self._fields, "path": path, "keys": keys, "shape": shape, "offset": offset, "digest": digest}
        else:
            fields = {**self._fields, "path": path, "keys": keys}
        object.__setattr__(leaf, "__dict__", fields)
        return leaf


def _types(value: Any, count: int, where: str) -> list[_Type]:
    if not isinstance(value, list) or not all(isinstance(doc, dict) for doc in value):
        raise ManifestError(f"The manifest of {where}: its 'types' must be a list of objects.")
    if len(value) > max(count, 1):
        raise ManifestError(f"The manifest of {where} has {len(value)} leaf types for {count} leaves; it is crafted.")
    types = []
    for doc in value:
        if not doc.keys() <= set(TYPE_FIELDS) or "kind" not in doc:
            raise ManifestError(
                f"The manifest of {where}: a leaf type {str(doc)[:200]} has fields other than {TYPE_FIELDS}, or no kind."
            )
        types.append(_Type(doc))
    return types


def _fields(value: Any, paths: list[str], where: str) -> dict[int, dict[str, Any]]:
    if not isinstance(value, dict):
        raise ManifestError(f"The manifest of {where}: its 'fields' must be an object.")
    fields = {}
    for key, other in value.items():
        digits = len(key) <= 20 and key.isascii() and key.isdecimal() and (key == "0" or key[0] != "0")
        if not (digits and int(key) < len(paths)):
            raise ManifestError(f"The manifest of {where}: 'fields' names leaf {key[:40]!r}, which it does not have.")
        if not isinstance(other, dict):
            raise ManifestError(f"Leaf {paths[int(key)]!r}: its fields must be an object.")
        if held := sorted(other.keys() & _NOT_FIELDS):
            raise ManifestError(
                f"Leaf {paths[int(key)]!r}: its fields hold {held}, which its columns or its type hold (a location "
                "and an offset: the 'offsets' column). The manifest is corrupt or crafted."
            )
        fields[int(key)] = other
    return fields


def _check_paths(paths: list[Any], where: str) -> tuple[set[str], list[str]]:
    """Every path is what `validate_path` passes (`validate_paths`, in bulk), and unique;
    no segment is the packed array's. Returns the set of them, and each one's parent."""
    validate_paths(paths)
    joined = "\n" + "\n".join(paths) + "\n"
    if PACKED_LOCATION in joined and re.search(rf"[/\n]{re.escape(PACKED_LOCATION)}[/\n]", joined):
        path = next(path for path in paths if PACKED_LOCATION in path.split("/"))
        raise ManifestError(f"The manifest of {where} names a leaf {path!r}, which no key's path can be.")
    parents = [path.rpartition("/")[0] for path in paths]
    unique = set(paths)
    if len(unique) != len(paths):
        seen: set[str] = set()
        twice = next(path for path in paths if path in seen or seen.add(path))
        raise ManifestError(f"The manifest of {where} lists the leaf path {twice!r} twice.")
    return unique, parents


def _check_compact_keys(
    paths: list[str], keys: list[Any], parents: list[str], compact: np.ndarray, where: str
) -> set[tuple[str, str]]:
    """Each compact key string (the leaves of ``compact``) spells its path: one character
    per segment, each segment the exact spelling of such a key. Checked once per distinct
    parent and string (siblings share theirs), and for each leaf's last segment where
    that is not plainly so: an int's (canonical decimal), or one with an escape.

    Returns the distinct ``(key string, parent)`` pairs, what `check_tree` walks."""
    if compact.all():
        branches = set(zip(keys, parents))
    else:
        at = np.flatnonzero(compact).tolist()
        branches = {(keys[i], parents[i]) for i in at}
    for chars, parent in branches:
        if not chars or (parent and compact_prefix(chars[:-1], parent) is None) or (not parent and len(chars) != 1):
            _refuse_keys(paths, keys, parents, lambda k, p, chars=chars, parent=parent: k == chars and p == parent)
    # The last segment's key: a str's segment spells it unless escaped; an int's must be decimal.
    if any(chars[-1] not in "ad" for chars, _ in branches):
        _refuse_keys(paths, keys, parents, _odd_last, compact)
    joined = "\n".join(paths)  # (one copy, searched at C speed)
    long = (
        max(map(len, paths), default=0) > MAX_SEGMENT
        and max(map(len, joined.replace("\n", "/").split("/"))) > MAX_SEGMENT
    )
    if "%" in joined or "~" in joined or long:
        _refuse_keys(paths, keys, parents, _odd_last, compact)
    return branches


def _odd_last(chars: str, path: str) -> bool:
    return compact_entry(chars[-1], path.rpartition("/")[2]) is None


def _refuse_keys(
    paths: list[str], keys: list[Any], parents: list[str], bad: Any, compact: np.ndarray | None = None
) -> None:
    """`parse_keys`' error for the first leaf whose compact keys and path (or parent)
    ``bad(keys, path)`` says are wrong; nothing if there is none."""
    for chars, parent, path, ok in zip(
        keys, parents, paths, compact if compact is not None else itertools.repeat(True)
    ):
        if ok and bad(chars, parent if compact is None else path):
            parse_keys(chars, path)  # raises, naming the leaf
            raise AssertionError("keys refused in bulk passed alone")  # pragma: no cover


def _check_unstored(
    paths: list[str], shapes: list[Any], offsets: list[Any], stored: np.ndarray, where: str
) -> np.ndarray:
    """Only ``stored`` leaves have shapes and offsets; returns which leaves are packed."""
    nones = itertools.repeat(None)
    has_shape = np.fromiter(map(operator.is_not, shapes, nones), bool, len(shapes))
    packed = np.fromiter(map(operator.is_not, offsets, nones), bool, len(offsets))
    wrong = np.flatnonzero((has_shape | packed) & ~stored)
    if wrong.size:
        raise ManifestError(
            f"Leaf {paths[wrong[0]]!r}: it has no stored array (its type's kind), but a shape or an offset. The "
            "manifest is corrupt or crafted."
        )
    return packed


def _digests(value: Any, count: int, where: str) -> str:
    """The digests column's bytes, checked to be ``count`` digests, in hex."""
    if not isinstance(value, str):
        raise ManifestError(f"The manifest of {where}: its {DIGESTS!r} column must be a base64 string.")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raw = None
    if raw is None or len(raw) != _DIGEST_BYTES * count or base64.b64encode(raw).decode() != value:
        raise ManifestError(
            f"The manifest of {where}: its {DIGESTS!r} column must be the base64 of {_DIGEST_BYTES} bytes for each "
            f"of the {count} stored leaves whose fields hold no digest. It is corrupt or crafted."
        )
    return raw.hex()


def _check_shapes(paths: list[str], shapes: list[Any], stored: np.ndarray, where: str) -> np.ndarray:
    """The stored leaves' shapes are what `parse_shape` passes: lists of at most
    `MAX_RANK` ints, each and their product (zeros counted as ones) below `MAX_ELEMENTS`.
    Checked in bulk, each distinct shape alone only where the largest dimension to the
    highest rank could reach the limit. Returns each leaf's number of elements (0 where
    it is not stored)."""
    at = np.flatnonzero(stored)
    listed = shapes if at.size == len(shapes) else [shapes[i] for i in at.tolist()]
    ok = set(map(type, listed)) <= {list}
    elements = np.zeros(len(shapes), np.int64)
    if ok and listed:
        flat = list(itertools.chain.from_iterable(listed))
        ranks = np.fromiter(map(len, listed), np.int64, len(listed))
        rank = int(ranks.max())
        ok = rank <= MAX_RANK and set(map(type, flat)) <= {int}  # (so that equal tuples are equal shapes)
        if ok and flat:
            largest = max(flat)
            ok = min(flat) >= 0 and largest < MAX_ELEMENTS
            if ok and largest > 1 and rank * math.log2(largest) >= 52:
                ok = all(map(_good_shape, set(map(tuple, listed))))
        if ok:  # each shape's product: its run of dimensions (none for a 0-d leaf, whose product is 1)
            elements[at] = 1
            ranked = ranks > 0
            if flat:
                starts = (np.cumsum(ranks) - ranks)[ranked]
                elements[at[ranked]] = np.multiply.reduceat(np.array(flat, np.int64), starts)
    if not ok:
        for i in at.tolist():
            parse_shape(shapes[i], paths[i])
        raise AssertionError("a shape refused in bulk passed alone")  # pragma: no cover
    return elements


@functools.lru_cache(maxsize=1 << 16)
def _good_shape(shape: tuple[int, ...]) -> bool:
    return len(shape) <= MAX_RANK and shape_refusal(shape) is None


def _check_offsets(
    paths: list[str], offsets: list[Any], packed: np.ndarray, elements: np.ndarray, units: np.ndarray, where: str
) -> None:
    """Packed offsets are non-negative multiples of `PACK_ALIGNMENT`, and no two packed
    leaves share bytes (`PackedArray.check_spans`); none ends past
    `MAX_ELEMENTS` (no packed array is longer). ``elements``, ``units``: each leaf's
    number of elements (below `MAX_ELEMENTS`) and bytes per element (at most one more)."""
    at = np.flatnonzero(packed)
    if not at.size:
        return
    listed = offsets if at.size == len(offsets) else [offsets[i] for i in at.tolist()]
    # Bounded in floats first: their product in int64 could wrap.
    ok = bool((elements[at].astype(np.float64) * units[at] <= MAX_ELEMENTS).all())
    sizes = elements[at] * units[at] if ok else np.zeros(at.size, np.int64)
    ok = ok and set(map(type, listed)) <= {int} and sizes.max() <= MAX_ELEMENTS
    starts = ends = np.zeros(0, np.int64)
    if ok:
        try:
            starts = np.array(listed, np.int64)
        except OverflowError:
            ok = False
        else:
            ends = starts + sizes
            ok = starts.min() >= 0 and not (starts % PACK_ALIGNMENT).any() and starts.max() <= MAX_ELEMENTS
            ok = ok and ends.max() <= MAX_ELEMENTS
    if not ok:  # exactly, in Python's ints
        nbytes = [int(e) * int(u) for e, u in zip(elements[at].tolist(), units[at].tolist())]
        bad = next(
            j
            for j, offset in enumerate(listed)
            if type(offset) is not int or not 0 <= offset <= MAX_ELEMENTS - nbytes[j] or offset % PACK_ALIGNMENT
        )
        raise ManifestError(
            f"Leaf {paths[at[bad]]!r}: its offset {listed[bad]!r} in the packed array must be a non-negative multiple "
            f"of {PACK_ALIGNMENT}, its bytes ending within {MAX_ELEMENTS}."
        )
    PackedArray.check_spans(starts, ends, paths if at.size == len(paths) else [paths[i] for i in at.tolist()], where)
