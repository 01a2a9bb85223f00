"""Key paths <-> path strings <-> directory names.

A leaf's path is one segment per key entry joined by ``/``. Segments are
percent-encoded outside a conservative alphabet so that they are always safe
directory names, and the encoding is injective:

- ``[A-Za-z0-9_.-]`` stay as they are, so ordinary identifiers are readable;
- every other character (``%``, ``/``, ``~``, space, unicode, control) becomes
  the ``%XX`` escapes of its UTF-8 bytes;
- the empty key is ``%``, and ``.``/``..`` become ``%2E``/``%2E%2E``;
- the manifest's own name is escaped so a key can never shadow it;
- a segment longer than `MAX_SEGMENT` keeps a readable prefix and ends in
  ``~`` plus a hash of the key (``~`` never appears unescaped otherwise).

The path string is therefore also the leaf's location inside the checkpoint.
"""

import difflib
import functools
import hashlib
import re
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any

from ._errors import ArgumentError, CheckpointError, ManifestError, PathError

if TYPE_CHECKING:
    from ._read._source import Source

MANIFEST_NAME = "eqxckpt.json"
# An object-store save's lease (see `_storage/_lease`): reserved like the manifest's name.
LEASE_NAME = "eqxckpt.lease.json"
# A manager's run: the identity of the run at the root of its directory (see `_steps`),
# beside its steps; no entry of the run (never a step, never deleted).
RUN_NAME = "eqxckpt-run.json"
# The directory a local tier keeps its parts in, under its `local_path` (which may be the
# run's own directory): like `RUN_NAME`, eqxckpt's, and no entry of a run.
LOCAL_TIER_NAME = "eqxckpt-local"
MAX_SEGMENT = 120
_SAFE = re.compile(r"[A-Za-z0-9_.\-]")
_SAFE_SEGMENT = re.compile(r"^[A-Za-z0-9_.\-%~]+$")
_SAFE_PATH_BYTES = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-%~" + b"/\n"  # as above
MAX_PATH_CHARS = 4096
_PLAIN_KEY = re.compile(rf"[A-Za-z0-9_.\-]{{1,{MAX_SEGMENT}}}")
# A zarr group's metadata file, in every directory above an array (see `group_locations`).
ZARR_NAME = "zarr.json"
_RESERVED = {
    ".": "%2E",
    "..": "%2E%2E",
    **{name: name.replace(".", "%2E") for name in (MANIFEST_NAME, LEASE_NAME, ZARR_NAME)},
}
_HASH_CHARS = 16
# Where small leaves' bytes are packed together (see `_pack`). `encode_segment` never
# makes a "%" that two hex digits do not follow, so no key's path can be this.
PACKED_LOCATION = "%packed"
# On object stores each save writes its arrays under a prefix of its own, named in the
# manifest (see `_objects`); like PACKED_LOCATION, no key's path can be such a name.
ARRAYS_PREFIX = "%arrays."
_ARRAYS_NAME = re.compile(r"^%arrays\.[0-9a-f]{32}$")
# Inside that prefix, the save's manifest, written before it commits: what cleanup
# writes in its place should the writer stop in the middle of committing.
COMMIT_NAME = "eqxckpt.commit.json"


def is_arrays_name(name: Any) -> bool:
    """Whether ``name`` is one eqxckpt gives a save's own prefix on an object store."""
    return isinstance(name, str) and _ARRAYS_NAME.fullmatch(name) is not None


# An incremental save on an object store refers to an unchanged leaf in a sibling
# checkpoint's prefix (a manager's earlier step) instead of writing it again: the
# leaf's "arrays" field is "../<entry>/%arrays.<hex>" (format version 4). Inside
# that prefix, each save that refers to it records a hold, and a deleter marks it
# doomed before deleting it (see `_holds.delete_unheld`). A prefix that its checkpoint
# no longer names (replaced or deleted) is first marked retired: cleanup deletes no
# other prefix that no lease names (a copy, a user's files). None of these names can
# be a leaf's path: `encode_segment` never makes a "%" without two hex digits after it.
HOLDS_NAME = "%holds"
DOOMED_NAME = "%doomed"
RETIRED_NAME = "%retired"
_ENTRY_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,119}$")
_REFERENCE = re.compile(r"^\.\./([^/]+)/([^/]+)$")


def is_entry_name(name: Any) -> bool:
    """Whether ``name`` may name a checkpoint beside another (a manager's step)."""
    return isinstance(name, str) and _ENTRY_NAME.fullmatch(name) is not None and name not in (MANIFEST_NAME, LEASE_NAME)


def reference(entry: str, arrays: str) -> str:
    """How a leaf names the prefix ``arrays`` of the sibling checkpoint ``entry``."""
    return f"../{entry}/{arrays}"


def parse_reference(ref: Any, where: str) -> tuple[str, str]:
    """(entry, arrays) of a leaf's reference to a sibling checkpoint's prefix; a
    `ManifestError` for anything else (a reference can name nothing but that)."""
    match = _REFERENCE.fullmatch(ref) if isinstance(ref, str) else None
    if match is None or not is_entry_name(match[1]) or not is_arrays_name(match[2]):
        raise ManifestError(
            f"Leaf {where!r}: its arrays {ref!r} must be '../<checkpoint beside this one>/{ARRAYS_PREFIX}<32 hex "
            "digits>'. The manifest is corrupt or crafted."
        )
    return match[1], match[2]


# Packed leaves start at multiples of this, so each can be adopted by XLA without a copy.
PACK_ALIGNMENT = 64


@functools.lru_cache(maxsize=1 << 16)  # keys repeat across leaves (layer names, "weight", indices)
def encode_segment(key: str) -> str:
    """Escape one key into a safe, readable directory name.

    ```python
    encode_segment("weight")  # 'weight'
    encode_segment("a/b")     # 'a%2Fb'
    ```
    """
    if key == "":
        return "%"
    if key in _RESERVED:
        return _RESERVED[key]
    if _PLAIN_KEY.fullmatch(key):  # the usual case, checked in one match
        return key
    out = []
    for char in key:
        if _SAFE.fullmatch(char):
            out.append(char)
        else:
            out.extend(f"%{b:02X}" for b in char.encode("utf-8", "surrogatepass"))
    encoded = "".join(out)
    if len(encoded) > MAX_SEGMENT:
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
        encoded = encoded[: MAX_SEGMENT - _HASH_CHARS - 1] + "~" + digest[:_HASH_CHARS]
    return encoded


def decode_segment(segment: str) -> str:
    """Invert `encode_segment` (for segments that were not shortened with a hash).

    ```python
    decode_segment("a%2Fb")  # 'a/b'
    ```
    """
    if segment == "%":
        return ""
    if "~" in segment:
        raise PathError(
            f"Segment {segment!r} was shortened with a hash and cannot be decoded; "
            "the manifest records the original key."
        )
    raw = bytearray()
    i = 0
    while i < len(segment):
        if segment[i] == "%":
            raw.append(int(segment[i + 1 : i + 3], 16))
            i += 3
        else:
            raw.extend(segment[i].encode())
            i += 1
    return raw.decode("utf-8", "surrogatepass")


def key_entry_segment(entry: Any) -> str:
    """The path segment of one `jax.tree_util` key entry."""
    return key_entry(entry)[1]


def key_entry(entry: Any) -> tuple[tuple, str]:
    """``(record, segment)``: `key_entry_record` (as a tuple) and the path segment of one
    `jax.tree_util` key entry.

    ```python
    import jax
    key_entry(jax.tree_util.DictKey("a/b"))  # (('dict', 'a/b'), 'a%2Fb')
    ```
    """
    field = _usual_key_fields().get(type(entry))
    key = None if field is None else getattr(entry, field)
    # Exactly a str or an int: equal keys of other types may differ as records (True and 1,
    # 0.0 and -0.0), and another kind of entry may hold more than its key.
    if type(key) is str or type(key) is int:
        return _usual_key_entry(type(entry), key)
    record = tuple(key_entry_record(entry))
    return record, record_segment(record)


@functools.lru_cache(maxsize=1 << 16)  # a tree repeats its keys across leaves ("weight", indices)
def _usual_key_entry(kind: type, key: str | int) -> tuple[tuple, str]:
    record = tuple(key_entry_record(kind(key)))
    return record, record_segment(record)


@functools.cache  # JAX is imported where it is needed, not to read a checkpoint
def _usual_key_fields() -> dict[type, str]:
    """The field holding the key of each usual kind of key entry."""
    import jax.tree_util as jtu

    return {jtu.GetAttrKey: "name", jtu.DictKey: "key", jtu.SequenceKey: "idx"}


def record_segment(record: list | tuple) -> str:
    """The path segment of a manifest key record (``["attr", "weight"]`` -> ``weight``)."""
    key = record[1]
    return str(key) if isinstance(key, int) else encode_segment(key)


def key_entry_record(entry: Any) -> list:
    """The manifest's record of one key entry: ``[kind, original value]``.

    Enough to rebuild nested dicts/lists without the code that made the tree.
    """
    import jax.tree_util as jtu

    kind = type(entry)  # the usual key types first, by identity (asked per key of every leaf)
    if kind is jtu.GetAttrKey:
        return ["attr", entry.name]
    if kind is jtu.DictKey and type(entry.key) is str:
        return ["dict", entry.key]
    if isinstance(entry, jtu.GetAttrKey):
        return ["attr", entry.name]
    if isinstance(entry, jtu.SequenceKey):
        return ["seq", entry.idx]
    if isinstance(entry, jtu.FlattenedIndexKey):
        return ["index", entry.key]
    if isinstance(entry, jtu.DictKey):
        key = entry.key
        if isinstance(key, (str, int)) and not isinstance(key, bool):
            return ["dict", key]
        return ["dict", str(key), "repr"]
    return ["attr", str(entry)]


def keypath_to_path(keypath: tuple) -> str:
    """Join a key path into the path string (``model/layers/0/weight``).

    ```python
    import jax
    (kp, _), = jax.tree_util.tree_flatten_with_path({"a": [1]})[0]
    keypath_to_path(kp)  # 'a/0'
    ```
    """
    return "/".join(key_entry_segment(entry) for entry in keypath)


def check_unique(paths_and_keypaths: list[tuple[str, tuple]]) -> None:
    """Refuse keys that would share a location, exactly or up to case.

    Two distinct keys can meet after escaping (``"1"`` and ``1`` in one dict) or
    on a case-insensitive store (``"W"`` and ``"w"``): one would overwrite the
    other, so saving stops with both names.
    """
    import jax.tree_util as jtu

    seen: dict[str, tuple] = {}
    prefixes: dict[str, tuple] = {}
    reserved = {MANIFEST_NAME.casefold(), LEASE_NAME.casefold()}
    for path, keypath in paths_and_keypaths:
        folded = path.casefold()
        parts = folded.split("/")
        if parts[0] in reserved:
            raise PathError(
                f"Leaf {jtu.keystr(keypath)} would be stored at {path!r}, which on a case-insensitive store is "
                f"eqxckpt's own {parts[0]!r}. Rename the key before saving."
            )
        if ZARR_NAME in parts:
            raise PathError(
                f"Leaf {jtu.keystr(keypath)} would be stored at {path!r}, which on a case-insensitive store is "
                f"the {ZARR_NAME!r} of a zarr group. Rename the key before saving."
            )
        other = seen.get(folded)
        if other is None and folded in prefixes:
            other = prefixes[folded]
        if other is not None:
            raise PathError(
                f"Leaves {jtu.keystr(other)} and {jtu.keystr(keypath)} would both be "
                f"stored at {path!r} (keys that differ only in type, such as 1 and "
                "'1', or only in case, cannot be told apart on disk). Rename one of "
                "the keys before saving."
            )
        seen[folded] = keypath
        for prefix in ancestors(folded):
            if prefix in seen:
                raise PathError(
                    f"Leaf {jtu.keystr(keypath)} would be stored inside leaf "
                    f"{jtu.keystr(seen[prefix])} (their paths differ only in case). "
                    "Rename one of the keys before saving."
                )
            prefixes.setdefault(prefix, keypath)


def validate_path(path: Any, *, what: str = "path") -> str:
    """Check a path read from a manifest before it is used to touch storage.

    Only what `encode_segment` can produce passes: relative, no empty, ``.`` or
    ``..`` segments, no backslash, NUL or control characters.
    """
    if not isinstance(path, str) or not path:
        raise ManifestError(f"Manifest {what} {path!r} is not a non-empty string.")
    if len(path) > MAX_PATH_CHARS:
        raise ManifestError(f"Manifest {what} is {len(path)} characters long; at most {MAX_PATH_CHARS} allowed.")
    for segment in path.split("/"):
        if segment in _SAFE_SEGMENTS_SEEN:
            continue
        if segment in (".", "..") or not _SAFE_SEGMENT.fullmatch(segment):
            raise ManifestError(
                f"Manifest {what} {path!r} has an unsafe segment {segment!r}: a checkpoint "
                "may only name locations inside itself. The manifest is corrupt or crafted."
            )
        if segment.casefold() in _OWN_FILES:  # up to case: case-insensitive filesystems and stores
            raise ManifestError(f"Manifest {what} {path!r} names eqxckpt's or zarr's own file {segment!r}.")
        if len(_SAFE_SEGMENTS_SEEN) >= 1 << 16:
            _SAFE_SEGMENTS_SEEN.clear()
        _SAFE_SEGMENTS_SEEN.add(segment)
    return path


def validate_paths(paths: list[Any], *, what: str = "path") -> None:
    """`validate_path` for many paths at once (a manifest's leaf table): the same rule,
    checked over them all joined between newlines at C speed; the first path that breaks
    it is named by `validate_path` itself.

    ```python
    validate_paths(["model/w", "model/b"])
    ```
    """
    if not set(map(type, paths)) <= {str} and all(isinstance(path, str) for path in paths):
        paths = [str(path) for path in paths]  # (a subclass of str: as `validate_path` takes it)
    ok = set(map(type, paths)) <= {str}
    if ok and paths:
        joined = "\n" + "\n".join(paths) + "\n"
        ok = joined.count("\n") == len(paths) + 1 and max(map(len, paths)) <= MAX_PATH_CHARS  # no newline of its own
        ok = ok and joined.isascii() and not joined.encode().translate(None, _SAFE_PATH_BYTES)
        ok = ok and "//" not in joined.replace("\n", "/")  # no empty segment
        folded = joined.casefold() if "." in joined else ""  # each name below has a dot
        ok = ok and not any(
            name in folded and re.search(rf"[/\n]{re.escape(name)}[/\n]", folded) for name in (".", "..", *_OWN_FILES)
        )
    if not ok:
        for path in paths:
            validate_path(path, what=what)
        raise AssertionError("paths refused in bulk passed one by one")  # pragma: no cover


# Segments that passed `validate_path`: the leaves of a manifest share most of theirs
# (every leaf of a layer names the layer), so each is checked once. Bounded.
_SAFE_SEGMENTS_SEEN: set[str] = set()
# No segment a key escapes to (`encode_segment`) is one of these, up to case.
_OWN_FILES = frozenset(name.casefold() for name in (MANIFEST_NAME, LEASE_NAME, ZARR_NAME))


def normalize_at(at: str | None) -> str:
    """Turn an ``at=`` selector into a path prefix ('' selects everything)."""
    if at is None:
        return ""
    if not isinstance(at, str):
        raise ArgumentError(f"at= must be a path string such as 'model/layers/0', got {type(at).__name__}.")
    return at.strip("/")


def depth(prefix: str) -> int:
    """Number of segments in a normalised prefix ('' has none)."""
    return len(prefix.split("/")) if prefix else 0


def relative_to(path: str, prefix: str) -> str | None:
    """``path`` relative to ``prefix``, or None if it is not under it."""
    if not prefix:
        return path
    if path == prefix:
        return ""
    if path.startswith(prefix + "/"):
        return path[len(prefix) + 1 :]
    return None


# What makes the checkpoint's root and each directory above an array a zarr v3 group,
# so zarr and xarray tools browse the checkpoint as one hierarchy.
GROUP_METADATA = b'{"zarr_format": 3, "node_type": "group", "attributes": {}}\n'


def ancestors(path: str) -> list[str]:
    """The paths that hold ``path``, outermost first (``a/b/c``: ``a``, ``a/b``)."""
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


def group_locations(paths: Iterable[str]) -> list[str]:
    """The directories above the arrays at ``paths`` ("" is the root), parents first."""
    groups = {""}
    for path in paths:
        groups.update(ancestors(path))
    return sorted(groups, key=lambda g: (g.count("/") + bool(g), g))


def group_file(group: str) -> str:
    """The key of a group's metadata: ``zarr.json`` in its directory."""
    return f"{group}/{ZARR_NAME}" if group else ZARR_NAME


def check_one_tree(leaves: Collection[str], location: Any, name: Any = None) -> None:
    """Refuse leaf paths that do not describe one tree: a path that is a leaf and also holds
    other leaves (``a`` and ``a/c``) would lose one of them when the tree is rebuilt.
    ``name(path)`` is what the format calls the leaf (``a.c`` for safetensors)."""
    name = name or (lambda path: path)
    for path in leaves:
        for prefix in ancestors(path):
            if prefix in leaves:
                raise ManifestError(
                    f"{location}: {name(prefix)!r} is a tensor and also holds {name(path)!r}; one tree cannot "
                    "have both (one would be lost). Open it through a CheckpointTranslator that renames one of them."
                )


def did_you_mean(wanted: str, known: Iterable[str]) -> str:
    """`` Did you mean 'a/b'?`` naming the paths closest to ``wanted``, or "" if none is close."""
    close = difflib.get_close_matches(wanted, known, n=3)
    return f" Did you mean {', '.join(map(repr, close))}?" if close else ""


def nothing_under(source: "Source", at: str | None) -> CheckpointError:
    """The error for an ``at=`` that selects nothing: the closest paths as deep as it
    (``model/layer/0``: ``model/layers/0``), a hint where it is written with dots or
    brackets (``model.layers[0]``), and what is at the top level."""
    prefix = normalize_at(at)
    tops = sorted({path.split("/")[0] for path in source.paths})
    # Python's spelling of a key path (`jax.tree_util.keystr`, attribute access) into eqxckpt's.
    slashed = re.sub(r"\[['\"]?([^\]'\"]*)['\"]?\]", r".\1", prefix).strip(".").replace(".", "/")
    try:
        selects = slashed != prefix and bool(source.records(slashed))
    except CheckpointError:  # not a path at all ('model///w')
        selects = False
    if selects:  # offered only where it selects something
        hint = f" Paths use '/' between keys (at={slashed!r}, not at={prefix!r})."
    else:
        keys = depth(slashed)
        as_deep = {"/".join(path.split("/")[:keys]) for path in source.paths if depth(path) >= keys}
        hint = did_you_mean(slashed, as_deep)
        if slashed != prefix and "" not in slashed.split("/"):  # written with dots or brackets
            hint += " Paths use '/' between keys, not '.' or '[...]'."
    return CheckpointError(
        f"Nothing under at={at!r} in {source.location}.{hint} Its top-level entries are: {', '.join(tops) or 'none'}."
    )
