"""Leaves' key records in a manifest: checked to spell their paths, written compactly
where the path spells them, and checked to describe one tree together."""

import functools
from collections.abc import Sequence
from typing import Any

from .._errors import ManifestError
from .._leaf import KeyRecord, Leaf
from .._paths import PathError, decode_segment, encode_segment, record_segment

KEY_KINDS = ("attr", "dict", "seq", "index")
# A sequence's largest index may exceed its number of leaves (empty subtrees
# leave gaps), by at most this much.
MAX_GAP_FACTOR, MAX_GAP = 2, 64
# A compact key record (format version 5): one character per path segment, the key
# being the segment decoded ("a", "d") or read as a decimal int ("n", "s", "i").
COMPACT_KINDS = {"a": ("attr", str), "d": ("dict", str), "n": ("dict", int), "s": ("seq", int), "i": ("index", int)}
_COMPACT_CHAR = {(kind, type_): char for char, (kind, type_) in COMPACT_KINDS.items()}
_LIST_KINDS = ("seq", "index")


@functools.lru_cache(maxsize=1 << 16)
def _plain_segment(kind: str, key: str | int) -> str | None:
    """The path segment of the key entry ``[kind, key]`` (``key`` exactly a str or an int),
    or None if it is not a valid entry: the entries of a manifest repeat (every leaf of a
    layer names the layer), so each is checked once."""
    if kind in _LIST_KINDS:
        ok = type(key) is int and key >= 0
    else:
        ok = kind in KEY_KINDS and (type(key) is str or kind == "dict")
    return record_segment((kind, key)) if ok else None


def parse_keys(value: Any, path: str) -> tuple[KeyRecord, ...]:
    """The key records ``value`` of the leaf at ``path`` (its ``keys`` as a manifest holds
    them: a list of ``[kind, key]``, or a compact string), checked to spell ``path``;
    `ManifestError` if they do not."""
    if type(value) is str:
        keys = compact_keys(value, path)
        if keys is None:
            raise ManifestError(
                f"Leaf {path!r}: its compact keys {value[:80]!r} do not spell its path (one of "
                f"{''.join(COMPACT_KINDS)} per segment, each segment the key's own spelling)."
            )
        return keys
    if type(value) is list and value:
        # The usual entries, [kind, a str or an int] each, one cache lookup each.
        keys = []
        segments = []
        for entry in value:
            if type(entry) is not list or len(entry) != 2:
                break
            kind, key = entry
            # Exact types only: a cache lookup would take True for 1 and 1.0 for 1.
            if type(kind) is not str or (type(key) is not str and type(key) is not int):
                break
            segment = _plain_segment(kind, key)
            if segment is None:
                break
            keys.append((kind, key))
            segments.append(segment)
        else:
            if "/".join(segments) == path:
                return tuple(keys)
    return _unusual_keys(value, path)  # and what is wrong with them, if anything


def _unusual_keys(value: Any, path: str) -> tuple[KeyRecord, ...]:
    if not isinstance(value, list) or len(value) != len(path.split("/")) or not value:
        raise ManifestError(f"Leaf {path!r}: 'keys' must list one [kind, key] per path segment.")
    keys = []
    segments = []
    for entry in value:
        ok = isinstance(entry, list) and len(entry) in (2, 3) and entry[0] in KEY_KINDS
        if ok and entry[0] in _LIST_KINDS:
            ok = isinstance(entry[1], int) and not isinstance(entry[1], bool) and entry[1] >= 0
        elif ok:
            ok = isinstance(entry[1], str) or (
                entry[0] == "dict" and isinstance(entry[1], int) and not isinstance(entry[1], bool)
            )
        if not ok or (len(entry) == 3 and entry[2] != "repr"):
            raise ManifestError(f"Leaf {path!r}: key entry {entry!r} is not [kind, key] with kind in {KEY_KINDS}.")
        keys.append(tuple(entry))
        segments.append(record_segment(entry))
    if "/".join(segments) != path:
        raise ManifestError(f"Leaf {path!r}: its keys {value!r} do not spell its path.")
    return tuple(keys)


# --- compact key records (version 5) --------------------------------------------------


@functools.lru_cache(maxsize=1 << 16)
def _compact_char(kind: str, key: Any) -> tuple[str, str] | None:
    """The compact character of the key record ``(kind, key)`` and its path segment, or
    None where the segment does not spell it back exactly (a key shortened with a hash)."""
    char = _COMPACT_CHAR.get((kind, type(key)))
    if char is None or (type(key) is int and key < 0):
        return None
    segment = record_segment((kind, key))
    return (char, segment) if compact_entry(char, segment) == (kind, key) else None


def compact_keys_of(keys: Sequence[Any], path: str) -> str | None:
    """``keys`` (a leaf's records, each ``[kind, key]``) as one compact character per
    segment, or None where some key is not spelled back exactly by its segment, or they do
    not spell ``path``."""
    chars = []
    segments = []
    for entry in keys:
        ok = len(entry) == 2 and type(entry[0]) is str and type(entry[1]) in (str, int)  # (hashable, exactly)
        spelled = _compact_char(entry[0], entry[1]) if ok else None
        if spelled is None:
            return None
        chars.append(spelled[0])
        segments.append(spelled[1])
    return "".join(chars) if "/".join(segments) == path else None


@functools.lru_cache(maxsize=1 << 16)
def compact_entry(char: str, segment: str) -> KeyRecord | None:
    """The key record that the compact ``char`` makes of ``segment``; None if the segment
    is not the exact spelling of such a key (so that a path has one set of keys)."""
    kind_type = COMPACT_KINDS.get(char)
    if kind_type is None:
        return None
    kind, type_ = kind_type
    if type_ is int:
        if not (segment.isascii() and segment.isdecimal()) or (segment[0] == "0" and segment != "0"):
            return None
        return (kind, int(segment))
    try:
        key = decode_segment(segment)
    except (PathError, ValueError, UnicodeDecodeError):
        return None
    return (kind, key) if encode_segment(key) == segment else None


@functools.lru_cache(maxsize=1 << 14)
def compact_prefix(chars: str, path: str) -> tuple[KeyRecord, ...] | None:
    if chars.count("/") or len(chars) != path.count("/") + 1:
        return None
    keys = tuple(compact_entry(c, s) for c, s in zip(chars, path.split("/")))
    return None if None in keys else keys  # type: ignore[return-value]


def compact_keys(chars: str, path: str) -> tuple[KeyRecord, ...] | None:
    """The key records the compact ``chars`` make of ``path``'s segments, or None where
    they do not (a character per segment, each segment the exact spelling of its key).
    Siblings share their parent's records (cached)."""
    parent, _, last = path.rpartition("/")
    if not chars:
        return None
    entry = compact_entry(chars[-1], last)
    if entry is None:
        return None
    if not parent:
        return (entry,) if len(chars) == 1 else None
    head = compact_prefix(chars[:-1], parent)
    return None if head is None else (*head, entry)


# --- one tree -------------------------------------------------------------------------


def check_containers(records: Sequence[Leaf], where: str, sequences_complete: bool) -> None:
    """`check_tree` for records of any manifest."""
    paths = [record.path for record in records]
    parents = [path.rpartition("/")[0] for path in paths]
    branches = {(compact_kinds(record.keys), parent) for record, parent in zip(records, parents)}
    check_tree(paths, set(paths), parents, branches, where, sequences_complete)


_KIND_CHAR = {"attr": "a", "dict": "d", "seq": "s", "index": "i"}


def compact_kinds(keys: Sequence[KeyRecord]) -> str:
    """A character per key record of ``keys`` (checked ones) for its kind: what
    `check_tree` reads of them (a dict's int key is a ``"d"`` there, as its str ones)."""
    return "".join([_KIND_CHAR[entry[0]] for entry in keys])


def check_tree(
    paths: Sequence[str],
    unique: set[str],
    parents: Sequence[str],
    branches: set[tuple[str, str]],
    where: str,
    sequences_complete: bool,
) -> None:
    """Leaves must describe one tree: each container is of one kind (a list's keys or a
    mapping's), no leaf is also a container of others, and (``sequences_complete``) each
    sequence's indices are exactly ``0..n-1``.

    **Arguments:**

    - `paths`: the leaves' paths (checked to be spelled by their keys), `unique` as a set.
    - `parents`: each one's parent's path (``""`` at the top).
    - `branches`: the distinct ``(kinds, parent)`` of the leaves, kinds being a compact
      character per key (`compact_kinds`). Siblings share theirs, so what the keys say
      about the containers above them is walked once per distinct branch.
    - `where`: the checkpoint, as errors name it.
    - `sequences_complete`: the manifest's.
    """
    # Each leaf of a sequence is one of its indices.
    lists = {parent for chars, parent in branches if chars[-1] in "si"}
    leaf_indices: dict[str, set[int]] = {}
    if lists:
        for path, parent in zip(paths, parents):
            last = path[len(parent) + 1 :] if parent else path
            if parent in lists and last.isdecimal():  # (another key there: a clash the walk below names)
                leaf_indices.setdefault(parent, set()).add(int(last))
    if clash := unique.intersection(parent for _, parent in branches):
        name = min(clash)
        _inconsistent(where, name, next(path for path in paths if path.startswith(name + "/")))
    # The containers are walked in the order of their paths (each one's before those below
    # it, siblings together), holding only those above the one at hand: memory as deep as
    # the tree, never a container per path prefix (a deep path's would cost its square).
    stack: list[_Container] = []
    previous: list[str] = []

    def finish(container: _Container, segments: list[str], depth: int) -> None:
        found = (
            container.indices | leaf_indices.get(container.name or "", set())
            if container.name is not None
            else container.indices
        )
        if container.family != "l" or not found:
            return
        # A sequence is rebuilt (like=None) with one slot per index, so its
        # indices must be exactly 0..n-1: no crafted index allocates a huge
        # list, and no lost leaf becomes a silent None. Manifests written before
        # empty subtrees were recorded have gaps there (None, (), optax's
        # EmptyState()), but only a few per leaf.
        name = "/".join(segments[:depth])  # (only when refused: a join per container would cost the square)
        if sequences_complete and max(found) != len(found) - 1:
            raise ManifestError(
                f"The manifest of {where} is inconsistent at {name or '<root>'!r}: the sequence holds "
                f"indices {sorted(found)[:5]}{' ...' if len(found) > 5 else ''} (largest {max(found)}), not exactly "
                f"0..{len(found) - 1}: a leaf is missing from the manifest. The checkpoint is damaged or crafted."
            )
        if max(found) >= MAX_GAP_FACTOR * len(found) + MAX_GAP:
            raise ManifestError(
                f"The manifest of {where} is inconsistent at {name or '<root>'!r}: a sequence with "
                f"{len(found)} leaves claims index {max(found)}. The manifest is corrupt or crafted."
            )

    for chars, parent in sorted(branches, key=_tree_order):
        segments = parent.split("/") if parent else []
        common = 0
        while common < min(len(segments), len(previous)) and segments[common] == previous[common]:
            common += 1
        while len(stack) > common + 1:  # containers of the previous path below the shared ones
            finish(stack.pop(), previous, len(stack))
        for depth in range(len(segments) + 1):
            family = "l" if chars[depth] in "si" else "m"
            if depth == len(stack):
                stack.append(_Container(family))
            elif stack[depth].family != family:
                _inconsistent(where, "/".join(segments[:depth]), _under(paths, parents, parent))
            if depth < len(segments) and depth >= common:  # a child of this container not met before
                container = stack[depth]
                if family == "l":
                    container.indices.add(int(segments[depth]))
                if container.name is not None:  # a parent of leaves: is one of them named as this child?
                    child = f"{container.name}/{segments[depth]}" if container.name else segments[depth]
                    if child in unique:
                        _inconsistent(where, child, _under(paths, parents, parent))
        stack[len(segments)].name = parent
        previous = segments
    while stack:
        finish(stack.pop(), previous, len(stack))


class _Container:
    """A container `check_tree` is within: its family, its children's indices (a list's),
    and its path where it is the parent of leaves."""

    __slots__ = ("family", "indices", "name")

    def __init__(self, family: str):
        self.family = family
        self.indices: set[int] = set()
        self.name: str | None = None


def _tree_order(branch: tuple[str, str]) -> str:
    return branch[1].replace("/", "\x00")  # a container before what is below it, siblings together


def _under(paths: Sequence[str], parents: Sequence[str], parent: str) -> str:
    return next(path for path, p in zip(paths, parents) if p == parent or p.startswith(parent + "/"))


def _inconsistent(where: str, container: str, path: str) -> None:
    raise ManifestError(
        f"The manifest of {where} is inconsistent at {container or '<root>'!r}: leaf {path!r} "
        "disagrees with another leaf about what kind of container it is in."
    )
