"""What every leaf is (`Leaf`) and every stored one (`StoredLeaf`): paths, key records,
shapes, blocks, and the checks the manifest's fields get."""

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

import numpy as np

from .._digest import LeafDigest, parse_digest
from .._dtypes import STORED_DTYPES
from .._errors import ArgumentError, CorruptCheckpointError, ManifestError
from .._formats._convert import Adoptions
from .._paths import PACK_ALIGNMENT, PACKED_LOCATION, parse_reference
from .._read._place import Block, held_blocks
from .._tree import (
    describe_like,
)

if TYPE_CHECKING:  # JAX is imported where a leaf is restored or saved, not to read a manifest
    import jax

# One key entry: ("attr" | "dict" | "seq" | "index", key) plus "repr" for keys recorded by their repr.


KeyRecord = tuple[Any, ...]
ARRAY_TYPES = ("jax", "numpy", "numpy_scalar")
UNKNOWN = "unknown"  # the array type of foreign formats' leaves (never written into a manifest)
SCALAR_NAMES = ("int", "float", "bool", "complex", "str", "none")
MAX_RANK = 64
MAX_ELEMENTS = 1 << 53
# Most blocks a part's leaf may hold: one per device of the process that saved it.
MAX_BLOCKS = 4096
# Longest type or function name an opaque leaf's record keeps (`OpaqueLeaf.of` cuts longer ones).
MAX_NAME_CHARS = 1000


# Longest generation an object store reports for one object, hex-encoded (GCS: a number
# and a flag; S3: a quoted ETag); more objects than chunks a leaf may have are refused.
MAX_GENERATION_CHARS = 256
MAX_SEEN_OBJECTS = 1 << 17


@dataclasses.dataclass(frozen=True)
class Seen:
    """When the files or objects of a leaf's array that a save shares from an earlier
    checkpoint were last read and checked whole (every check `verify` makes), and the
    generation each of them had then (hex, in the order of their sorted keys): on an object
    store the one the store gave it, on a local disk its stamp (`_storage._stamps`).

    A later save shares the array without reading it while each file or object has that
    same generation (one metadata request per object, one ``lstat`` per file), for at
    most `FULL_CHECK_SHARES` saves and ``full_check_interval_s`` after the check; then it
    checks them whole again.

    **Attributes:** `unix`, when they were checked; `shares`, the saves that shared them
    since without reading them; `generations`.

    ```python
    Seen(1.7e9, 0, ("00226162...",))
    ```
    """

    unix: float
    shares: int
    generations: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"unix": self.unix, "shares": self.shares, "generations": list(self.generations)}

    @staticmethod
    def recordable(generations: Sequence[str]) -> bool:
        """Whether a manifest can hold these generations (what `from_json` accepts): a
        store's longer ones are not recorded, and the leaf is checked whole each time."""
        return 0 < len(generations) <= MAX_SEEN_OBJECTS and all(_generation_ok(g) for g in generations)

    @staticmethod
    def from_json(doc: Any, path: str) -> "Seen":
        """``doc`` checked to be a `Seen`'s JSON; a `ManifestError` naming ``path`` if not."""
        if not isinstance(doc, dict) or set(doc) != {"unix", "shares", "generations"}:
            raise ManifestError(f"Leaf {path!r}: 'seen' must hold exactly 'unix', 'shares' and 'generations'.")
        unix, shares, generations = doc["unix"], doc["shares"], doc["generations"]
        if isinstance(unix, bool) or not isinstance(unix, int | float) or not 0 <= unix < 1e11:
            raise ManifestError(f"Leaf {path!r}: 'seen' time {unix!r} is not a time.")
        if isinstance(shares, bool) or not isinstance(shares, int) or not 0 <= shares < 1 << 31:
            raise ManifestError(f"Leaf {path!r}: 'seen' shares {shares!r} must be a non-negative integer.")
        if not isinstance(generations, list) or not 0 < len(generations) <= MAX_SEEN_OBJECTS:
            raise ManifestError(f"Leaf {path!r}: 'seen' generations must be a list of 1 to {MAX_SEEN_OBJECTS}.")
        for generation in generations:
            if not _generation_ok(generation):
                raise ManifestError(
                    f"Leaf {path!r}: 'seen' generation {str(generation)[:80]!r} is not lowercase hex of 1 to "
                    f"{MAX_GENERATION_CHARS // 2} bytes."
                )
        return Seen(float(unix), shares, tuple(generations))


def _generation_ok(generation: Any) -> bool:
    return (
        isinstance(generation, str)
        and 0 < len(generation) <= MAX_GENERATION_CHARS
        and not len(generation) % 2
        and not generation.strip("0123456789abcdef")
    )


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One leaf of a checkpoint, as its manifest describes it: what `Source.leaf` and
    `Source.records` give, for every format. Its kind is one of `ArrayLeaf` and `KeyLeaf`
    (the `StoredLeaf`s, whose values are stored arrays), `ScalarLeaf` and `OpaqueLeaf`.

    **Attributes:** `path`, the leaf's path (``model/layers/0/weight``); `keys`, its key
    entries, each ``(kind, key)`` with kind ``attr``, ``dict``, ``seq`` or ``index``
    (``(("dict", "model"), ("attr", "layers"), ("seq", 0), ("attr", "weight"))``); `kind`,
    as the manifest records it (``array``, ``prng_key``, ``scalar``, ``opaque``).

    Leaves are immutable. Their other methods are how eqxckpt saves, checks and restores
    each kind, not part of the public interface.

    ```python
    leaf = ckpt.leaf("model/w")
    leaf.kind, leaf.describe(), leaf.nbytes  # ('array', 'float32[4,3]', 48)
    ```
    """

    path: str
    keys: tuple[KeyRecord, ...]
    kind: ClassVar[str] = ""
    stored: ClassVar[bool] = False

    @property
    def nbytes(self) -> int:
        """Bytes stored for this leaf's array (0 for scalars and opaque leaves).

        **Returns:** an int.

        ```python
        ckpt.leaf("model/w").nbytes  # 48
        ```
        """
        return 0

    @property
    def is_none(self) -> bool:
        """Whether the leaf records None (also what an empty subtree in a sequence is saved as)."""
        return False

    def describe(self) -> str:
        """A one-line summary, as errors and listings show the leaf.

        **Returns:** ``float32[4,3]``, ``key<threefry2x32>[8]``, ``int = 100``, ``<function ...>``.

        ```python
        ckpt.leaf("model/w").describe()  # 'float32[4,3]'
        ```
        """
        raise NotImplementedError

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "keys": [list(k) for k in self.keys], "kind": self.kind, **self._fields()}

    def _fields(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_json(cls, doc: dict[str, Any], path: str, keys: tuple[KeyRecord, ...]) -> "Leaf":
        raise NotImplementedError

    def mismatch(self, target: Any, cast: bool) -> str | None:
        """Why this leaf cannot restore into ``target`` (a leaf of `like`), or None if it can."""
        raise NotImplementedError

    def value(self, target: Any = None) -> Any:
        """The restored value of a leaf with no stored array (from the manifest, or ``target``)."""
        raise NotImplementedError

    def _differs(self, target: Any) -> str:
        return f"expected {describe_like(target)}, found {self.describe()}"


@dataclasses.dataclass(frozen=True)
class StoredLeaf(Leaf):
    """A leaf whose value is a stored array (an `ArrayLeaf` or a `KeyLeaf`), read on
    demand (`LazyArray`). In an eqxckpt checkpoint: its own zarr3 array at its path, or
    with an ``offset``, ``nbytes`` little-endian bytes at that offset of the packed array.

    **Attributes:** `shape`; `dtype`, the stored dtype's name (``float32``; a PRNG key
    array's key data's, ``uint32``); `digest`, the XXH3-128 digest eqxckpt recorded of
    its description and bytes (None where none was: other formats).

    ```python
    w = ckpt.leaf("model/w")
    isinstance(w, eqxckpt.StoredLeaf), w.shape, w.dtype  # (True, (4, 3), 'float32')
    ```
    """

    shape: tuple[int, ...]
    dtype: str
    offset: int | None = dataclasses.field(default=None, kw_only=True)
    # XXH3-128 of `digest_fields` and the stored bytes (see `_digest`); None: not recorded.
    digest: str | None = dataclasses.field(default=None, kw_only=True)
    # Where its array (for a packed leaf: the packed array) is when not in this checkpoint's
    # own prefix: a sibling checkpoint's (an incremental save on an object store; see
    # `_paths.parse_reference`).
    arrays: str | None = dataclasses.field(default=None, kw_only=True)
    # In a process's part of a checkpoint (a local tier's): the blocks of the stored array
    # (over `data_shape`) it holds, each one or more whole chunks; None: all of it.
    blocks: tuple[Block, ...] | None = dataclasses.field(default=None, kw_only=True)
    # For an array in a sibling's prefix (``arrays``): when it was last checked whole, and
    # the objects' generations then (`Seen`); None: a save that shares it checks it first.
    seen: Seen | None = dataclasses.field(default=None, kw_only=True)
    stored: ClassVar[bool] = True
    sliceable: ClassVar[bool] = True  # whether a lazy read may select part of it

    @property
    def data_shape(self) -> tuple[int, ...]:
        """Shape of the stored array."""
        return self.shape

    @property
    def location(self) -> str:
        """Where its bytes are: its own array's path, or the packed array's."""
        return self.path if self.offset is None else PACKED_LOCATION

    @property
    def nbytes(self) -> int:
        # Asked many times per leaf (planning, packing, reads, progress): kept once known.
        # Leaves are immutable, and `with_storage` changes nothing it depends on.
        known = self.__dict__.get("_nbytes")
        if known is None:
            if self.blocks is None:
                elements = math.prod(self.data_shape)
            else:
                elements = sum(math.prod(stop - start for start, stop in block) for block in self.blocks)
            known = self.__dict__["_nbytes"] = elements * _itemsize(self.dtype)
        return known

    def unheld(self, target: Any) -> str | None:
        """Why ``target`` needs blocks of this leaf that this part does not hold, or None
        (always, for a leaf stored whole). A part is restored onto the layout it was
        saved from: this process's blocks of ``target`` are the blocks it holds (each read
        whole, so that its digest is checked; a finer sharding would read parts of them)."""
        if self.blocks is None:
            return None
        held = f"this part holds only blocks {listed_blocks(self.blocks)} of {self.describe()}"
        sharding = getattr(target, "sharding", None)
        if isinstance(target, (np.ndarray, np.generic)) or sharding is None or not self.can_shard(sharding):
            return f"{held}; like asks for all of it (no sharding): give like the sharding it was saved with"
        try:
            wanted = held_blocks(sharding, self.shape, self.data_shape)
        except (ValueError, TypeError) as e:  # a sharding that does not fit the shape
            return f"{held}; like's sharding does not fit it: {e}"
        if set(wanted) != set(self.blocks):
            return (
                f"{held}; like's sharding asks for {listed_blocks(wanted[:8])}: restore onto the mesh it was saved from"
            )
        return None

    @property
    def value_dtype(self) -> np.dtype:
        """The dtype of the restored value."""
        return np.dtype(self.dtype)

    def narrowed(self, target: Any) -> str | None:
        """Why JAX would silently change the restored values, or None."""
        return None

    def can_shard(self, sharding: "jax.sharding.Sharding") -> bool:
        """Whether a read may be split by ``sharding``'s slices."""
        return True

    def check_known(self) -> None:
        """Raise if this JAX cannot restore the leaf (for `verify`)."""
        return None

    def host_value(self, data: np.ndarray, dtype: np.dtype | None) -> Any:
        """What a lazy read returns for ``data`` read into host memory, cast to ``dtype`` if given."""
        raise NotImplementedError

    def selection_nbytes(self, shape: tuple[int, ...], dtype: np.dtype) -> int:
        """Bytes a lazy read of ``shape`` (a selection of this leaf) returns as ``dtype``."""
        raise NotImplementedError

    def copied(
        self, path: str, keys: tuple[KeyRecord, ...], shape: tuple[int, ...], dtype: np.dtype, *, changed: bool
    ) -> "StoredLeaf":
        """The leaf a lazy view of this one (``changed``: sliced or cast) becomes when saved at ``path``."""
        raise NotImplementedError

    def finish(self, data: np.ndarray, target: Any, adoptions: "Adoptions | None" = None) -> Any:
        """Stored data (read whole into host memory) as the value ``target`` asks for.
        With ``adoptions``, a jax array on one CPU device may be left to them to make,
        with others (an `Adoption` is returned: its ``value``, once they are placed)."""
        raise NotImplementedError

    def value(self, target: Any = None) -> Any:
        raise ArgumentError(
            f"Leaf {self.path!r} ({self.describe()}) is a stored array, with no value in the manifest: read it "
            "with ckpt[path].get() (numpy) or eqxckpt.load."
        )

    def host_target(self) -> Any:
        """What to read this leaf into (`Source.read`) for its values as stored, in host
        memory, never on a device: None (as saved) where that is what saved means here."""
        return None

    def placement(self, target: Any) -> "tuple[jax.sharding.Sharding, np.dtype] | None":
        """Where and as what `finish` would put this leaf restored into ``target``: the
        sharding of the jax array it gives and the dtype of its stored data there (for
        PRNG keys, key data), or None where it gives a host value (numpy)."""
        return None

    def assemble(self, target: Any, place: Any) -> "jax.Array":
        """The value for ``target`` from ``place(convert)``: the stored data on its devices
        (`Placement.run`), each part of it passed through ``convert`` (checks, a cast)."""
        raise NotImplementedError

    def digest_fields(self) -> list[Any]:
        """What the digest covers besides the bytes: the kind, the stored dtype and shape."""
        return [self.kind, self.dtype, list(self.data_shape)]

    def digesting(self) -> LeafDigest | None:
        """A digest of this leaf to feed its stored bytes as they are read (a part's leaf:
        block by block), or None where the manifest records none."""
        if self.digest is None:
            return None
        return LeafDigest(self.digest_fields(), None if self.blocks is None else len(self.blocks))

    def check_digest(self, value: str) -> None:
        """Raise `CorruptCheckpointError` unless ``value``, the digest of the bytes read, is
        the one the manifest records: chunks that pass their checksums but are swapped
        between places or rewritten as other valid chunks."""
        if value != self.digest:
            raise CorruptCheckpointError(
                f"Leaf {self.path!r}: its bytes pass their chunks' checksums but are not the bytes saved (digest {value}, the "
                f"manifest records {self.digest}): chunks were swapped or rewritten. Restore it from a copy.",
                leaf_path=self.path,
            )

    def check_whole(self, data: Any) -> None:
        """Raise unless ``data``, all of this leaf's stored values in C order (as read whole,
        any dtype's bytes as stored), is what was saved: a kind this JAX knows, then the
        manifest's digest. The one check of a leaf read whole (a restore, a lazy read, a
        layer of a `Stack`, a transposed view's original); a part's leaf is checked block by
        block as it is placed (`PlacedDigest`), a leaf read in pieces by `verify`."""
        if self.digest is None or self.blocks is not None:
            return
        self.check_known()  # what it is (a PRNG implementation) before what it holds
        digesting = LeafDigest(self.digest_fields())
        digesting.update(data)
        self.check_digest(digesting.value)

    def _fields(self) -> dict[str, Any]:
        fields = {"shape": list(self.shape), "dtype": self.dtype, "location": self.location}
        if self.offset is not None:
            fields["offset"] = self.offset
        if self.arrays is not None:
            fields["arrays"] = self.arrays
        if self.blocks is not None:
            fields["blocks"] = [[list(dim) for dim in block] for block in self.blocks]
        if self.seen is not None:
            fields["seen"] = self.seen.to_json()
        return fields if self.digest is None else {**fields, "digest": self.digest}

    @staticmethod
    def _stored(doc: dict[str, Any], path: str) -> tuple[tuple[int, ...], str, dict[str, Any]]:
        """Shape, dtype, and the keyword fields: packed offset (None: its own array at its
        path), digest, and the sibling prefix its array is in (None: this checkpoint's)."""
        location, offset = doc.get("location"), doc.get("offset")
        if location == PACKED_LOCATION:
            # Below MAX_ELEMENTS, as no packed array is longer: its members' ends fit an int64 then.
            bad = not isinstance(offset, int) or isinstance(offset, bool) or not 0 <= offset < MAX_ELEMENTS
            if bad or cast(int, offset) % PACK_ALIGNMENT:
                raise ManifestError(
                    f"Leaf {path!r}: its offset {offset!r} in the packed array must be a non-negative "
                    f"multiple of {PACK_ALIGNMENT} below {MAX_ELEMENTS}."
                )
        elif location != path or offset is not None:
            raise ManifestError(
                f"Leaf {path!r}: its location {location!r} must equal its path (or be {PACKED_LOCATION!r} "
                "with an offset)."
            )
        dtype = doc.get("dtype")
        if not isinstance(dtype, str) or dtype not in STORED_DTYPES:
            raise ManifestError(f"Leaf {path!r}: unknown dtype {dtype!r}.")
        arrays = doc.get("arrays")
        if arrays is not None:
            parse_reference(arrays, path)
        fields = {"offset": offset, "digest": parse_digest(doc.get("digest"), path), "arrays": arrays}
        if "seen" in doc:
            if offset is not None:
                raise ManifestError(f"Leaf {path!r}: only an array of its own records when it was 'seen'.")
            fields["seen"] = Seen.from_json(doc["seen"], path)
        if "blocks" in doc:
            if offset is not None:
                raise ManifestError(f"Leaf {path!r}: a packed leaf cannot hold blocks of itself.")
            fields["blocks"] = parse_blocks(doc["blocks"], path)
        return parse_shape(doc.get("shape"), path), dtype, fields

    def __post_init__(self) -> None:
        if self.blocks is not None:
            check_blocks(self.blocks, self.data_shape, self.path)


_ITEMSIZES: dict[str, int] = {}


def _itemsize(dtype: str) -> int:
    """A stored dtype's item size; asked many times per leaf (planning, packing, reads)."""
    size = _ITEMSIZES.get(dtype)
    if size is None:
        size = _ITEMSIZES[dtype] = np.dtype(dtype).itemsize
    return size


_Stored = TypeVar("_Stored", bound=StoredLeaf)


def with_storage(leaf: _Stored, **changes: Any) -> _Stored:
    """``leaf`` with another ``offset``, ``digest``, ``arrays`` or ``seen``: what `dataclasses.replace`
    gives, without its per-call introspection (a save places and digests every leaf of
    its tree). Nothing derived from the other fields changes."""
    assert changes.keys() <= {"offset", "digest", "arrays", "blocks", "seen"}
    changed = object.__new__(type(leaf))
    changed.__dict__.update(leaf.__dict__, **changes)
    changed.__dict__.pop("_line", None)  # its manifest line (`_manifest`) changes with them
    if "blocks" in changes:
        changed.__dict__.pop("_nbytes", None)
        check_blocks(changes["blocks"], leaf.data_shape, leaf.path)
    return changed


def leaf_type_name(doc: dict[str, Any], path: str) -> str:
    found = doc.get("type")
    if not isinstance(found, str) or len(found) > MAX_NAME_CHARS:
        raise ManifestError(f"Leaf {path!r}: 'type' must be a string of at most {MAX_NAME_CHARS} characters.")
    return found


def parse_shape(value: Any, where: str) -> tuple[int, ...]:
    """A shape from the manifest: at most `MAX_RANK` non-negative ints, fewer than 2**53 elements."""
    if not isinstance(value, list) or len(value) > MAX_RANK:
        raise ManifestError(f"Leaf {where!r}: shape must be a list of at most {MAX_RANK} ints, found {value!r}.")
    if why := shape_refusal(value):
        raise ManifestError(f"Leaf {where!r}: shape {value!r} {why}.")
    return tuple(value)


def shape_refusal(shape: Sequence[Any]) -> str | None:
    """Why a reader refuses ``shape`` (a list of at most `MAX_RANK` entries), or None: the
    check a load applies and a save applies first, so that no save writes what a load
    refuses."""
    elements = 1  # zero dimensions counted as one: numpy refuses an empty array whose other dimensions overflow
    for d in shape:  # one plain loop: every leaf of a manifest has a shape
        if not isinstance(d, int) or isinstance(d, bool) or not 0 <= d < MAX_ELEMENTS:
            return "has a negative, huge or non-integer dimension"
        if d > 1:
            elements *= d
    if elements >= MAX_ELEMENTS:
        return "declares an absurd number of elements"
    return None


def parse_blocks(value: Any, path: str) -> tuple[Block, ...]:
    """A part's leaf's held blocks from the manifest: at most `MAX_BLOCKS` lists of
    ``[start, stop]`` int pairs (checked against the shape by `check_blocks`)."""
    bad = ManifestError(
        f"Leaf {path!r}: blocks must be a list of at most {MAX_BLOCKS} blocks, each a [start, stop] pair of ints "
        f"per dimension; found {str(value)[:200]}."
    )
    if not isinstance(value, list) or not 0 < len(value) <= MAX_BLOCKS:
        raise bad
    blocks = []
    for block in value:
        if not isinstance(block, list) or len(block) > MAX_RANK:
            raise bad
        dims = []
        for dim in block:
            if not (
                isinstance(dim, list)
                and len(dim) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) for x in dim)
            ):
                raise bad
            dims.append((dim[0], dim[1]))
        blocks.append(tuple(dims))
    return tuple(blocks)


def check_blocks(blocks: tuple[Block, ...], shape: tuple[int, ...], path: str) -> None:
    """Raise `ManifestError` unless ``blocks`` are distinct cells of one regular grid over
    ``shape`` (as a sharding's blocks are: so they are disjoint, checked in one pass) that
    do not cover all of it (a part holding every block stores the leaf whole)."""
    for block in blocks:
        if len(block) != len(shape) or not all(0 <= a < b <= n for (a, b), n in zip(block, shape)):
            raise ManifestError(
                f"Leaf {path!r}: block {listed_blocks([block])} is not a non-empty block of shape {list(shape)}."
            )
    cell = [max(b - a for a, b in dims) for dims in zip(*blocks)]
    for block in blocks:
        if not all(a % c == 0 and b == min(a + c, n) for (a, b), c, n in zip(block, cell, shape)):
            raise ManifestError(f"Leaf {path!r}: blocks {listed_blocks(blocks[:8])} are not the cells of one grid.")
    if len({tuple(a for a, _ in block) for block in blocks}) != len(blocks):
        raise ManifestError(f"Leaf {path!r}: blocks {listed_blocks(blocks[:8])} repeat one.")
    if sum(math.prod(b - a for a, b in block) for block in blocks) >= math.prod(shape):
        raise ManifestError(f"Leaf {path!r}: its blocks cover all of shape {list(shape)}; it would be stored whole.")


def listed_blocks(blocks: Iterable[Block]) -> str:
    """Blocks as a user reads them: ``[0:4, 0:3]``."""
    return ", ".join("[" + ", ".join(f"{a}:{b}" for a, b in block) + "]" for block in blocks)
