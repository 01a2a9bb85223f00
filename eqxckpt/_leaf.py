"""Leaf kinds: what one leaf of a checkpoint is, and how each kind is saved,
written into the manifest, checked against `like`, and restored. The kinds (each
class's docstring says what it stores): `ArrayLeaf` and `KeyLeaf`, the
`StoredLeaf`s; `ScalarLeaf`, whose value is in the manifest; `OpaqueLeaf`, whose
value `load` takes from `like`. A new kind is one class here, registered in `KINDS`.
"""

import dataclasses
import enum
import functools
import math
import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import numpy as np

from ._digest import LeafDigest, parse_digest
from ._dtypes import STORED_DTYPES, check_dtype, dtype_name
from ._errors import MAX_LISTED, ArgumentError, CastError, CorruptCheckpointError, ManifestError, UnsupportedLeafError
from ._formats._convert import Adoptions, adopt, checked_astype, default_device, narrowed
from ._paths import PACK_ALIGNMENT, PACKED_LOCATION, parse_reference, validate_path
from ._read._place import Block, held_blocks
from ._scalars import bits_fit, nan_bits, scalar_from_json, scalar_to_json, with_bits
from ._tree import (
    SCALAR_TYPES,
    describe_like,
    is_array_like,
    is_prng_key_dtype,
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

    def _fields(self) -> dict[str, Any]:
        fields = {"shape": list(self.shape), "dtype": self.dtype, "location": self.location}
        if self.offset is not None:
            fields["offset"] = self.offset
        if self.arrays is not None:
            fields["arrays"] = self.arrays
        if self.blocks is not None:
            fields["blocks"] = [[list(dim) for dim in block] for block in self.blocks]
        return fields if self.digest is None else {**fields, "digest": self.digest}

    @staticmethod
    def _stored(doc: dict[str, Any], path: str) -> tuple[tuple[int, ...], str, dict[str, Any]]:
        """Shape, dtype, and the keyword fields: packed offset (None: its own array at its
        path), digest, and the sibling prefix its array is in (None: this checkpoint's)."""
        location, offset = doc.get("location"), doc.get("offset")
        if location == PACKED_LOCATION:
            if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0 or offset % PACK_ALIGNMENT:
                raise ManifestError(
                    f"Leaf {path!r}: its offset {offset!r} in the packed array must be a non-negative "
                    f"multiple of {PACK_ALIGNMENT}."
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
    """``leaf`` with another ``offset``, ``digest`` or ``arrays``: what `dataclasses.replace`
    gives, without its per-call introspection (a save places and digests every leaf of
    its tree). Nothing derived from the other fields changes."""
    assert changes.keys() <= {"offset", "digest", "arrays", "blocks"}
    changed = object.__new__(type(leaf))
    changed.__dict__.update(leaf.__dict__, **changes)
    changed.__dict__.pop("_line", None)  # its manifest line (`_manifest`) changes with them
    if "blocks" in changes:
        changed.__dict__.pop("_nbytes", None)
        check_blocks(changes["blocks"], leaf.data_shape, leaf.path)
    return changed


@dataclasses.dataclass(frozen=True)
class ArrayLeaf(StoredLeaf):
    """An array leaf.

    **Attributes:** as a `StoredLeaf`'s, and `array_type`: what it was saved from and
    what `load` gives back with ``like=None`` or a skeleton (``jax``, ``numpy``,
    ``numpy_scalar``). Other formats record none (``unknown``): numpy arrays for
    ``like=None``, jax arrays for a skeleton.

    ```python
    ckpt.leaf("model/w").array_type  # 'numpy'
    ```
    """

    array_type: str = "numpy"
    kind: ClassVar[str] = "array"

    def describe(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "array_type": self.array_type}

    @classmethod
    def from_json(cls, doc: dict[str, Any], path: str, keys: tuple[KeyRecord, ...]) -> "ArrayLeaf":
        shape, dtype, fields = cls._stored(doc, path)
        if doc.get("array_type") not in ARRAY_TYPES:
            raise ManifestError(f"Leaf {path!r}: unknown array_type {doc.get('array_type')!r}.")
        return cls(path, keys, shape, dtype, doc["array_type"], **fields)

    def mismatch(self, target: Any, cast: bool) -> str | None:
        if not is_array_like(target) or is_prng_key_dtype(target.dtype):
            return self._differs(target)
        if dtype_name(target.dtype) != self.dtype and not cast:
            return f"{self._differs(target)} (pass cast=True to convert)"
        if tuple(np.shape(target)) != self.shape:
            return self._differs(target)
        if (why := self.narrowed(target)) is not None:
            return f"found {self.describe()}, which cannot be restored as it is: {why}"
        return self.unheld(target)

    def host_target(self) -> np.ndarray:
        # A numpy array of the stored dtype and shape with no memory of its own (broadcast).
        return np.broadcast_to(np.zeros((), self.dtype), self.shape)

    def narrowed(self, target: Any) -> str | None:
        import jax

        dtype = np.dtype(getattr(target, "dtype", None) or self.dtype)
        into_jax = (
            isinstance(target, jax.Array)
            or (
                (target is None or isinstance(target, jax.ShapeDtypeStruct))
                and (self.array_type == "jax" or getattr(target, "sharding", None) is not None)
            )
            or (isinstance(target, jax.ShapeDtypeStruct) and self.array_type == UNKNOWN)
        )
        return narrowed(dtype, into_jax)

    def finish(self, data: np.ndarray, target: Any, adoptions: "Adoptions | None" = None) -> Any:
        import jax

        check_bool_bytes(data, self.path)
        if data.dtype != np.dtype(getattr(target, "dtype", data.dtype)):
            data = checked_astype(data, target.dtype, self.path)
        sharding = getattr(target, "sharding", None)
        if isinstance(target, np.ndarray):
            return data
        if isinstance(target, np.generic):
            return data[()]
        if target is None or (isinstance(target, jax.ShapeDtypeStruct) and sharding is None):
            # No concrete type asked for (like=None or a skeleton): give back what was saved.
            if self.array_type == "numpy" or (target is None and self.array_type == UNKNOWN):
                return data
            if self.array_type == "numpy_scalar":
                return data[()]
        return adopt(data, sharding, adoptions)

    def host_value(self, data: np.ndarray, dtype: np.dtype | None) -> Any:
        check_bool_bytes(data, self.path)
        return data if dtype is None else data.astype(dtype)

    def selection_nbytes(self, shape: tuple[int, ...], dtype: np.dtype) -> int:
        return math.prod(shape) * dtype.itemsize

    def copied(
        self, path: str, keys: tuple[KeyRecord, ...], shape: tuple[int, ...], dtype: np.dtype, *, changed: bool
    ) -> "ArrayLeaf":
        check_dtype(dtype, path)
        array_type = self.array_type if self.array_type in ARRAY_TYPES else "numpy"
        return ArrayLeaf(path, keys, shape, dtype.name, array_type, digest=None if changed else self.digest)

    def placement(self, target: Any) -> "tuple[jax.sharding.Sharding, np.dtype] | None":
        import jax

        if isinstance(target, (np.ndarray, np.generic)):
            return None
        sharding = getattr(target, "sharding", None)
        if sharding is None:
            if (target is None or isinstance(target, jax.ShapeDtypeStruct)) and (
                self.array_type in ("numpy", "numpy_scalar") or (target is None and self.array_type == UNKNOWN)
            ):
                return None  # as `finish`: a host value
            device = default_device()
            if device is None:
                return None
            sharding = jax.sharding.SingleDeviceSharding(device)
        dtype = getattr(target, "dtype", None)
        return sharding, np.dtype(self.dtype if dtype is None else dtype)

    def assemble(self, target: Any, place: Any) -> "jax.Array":
        dtype = np.dtype(self.dtype if getattr(target, "dtype", None) is None else target.dtype)

        def convert(data: np.ndarray) -> np.ndarray:
            check_bool_bytes(data, self.path)
            return checked_astype(data, dtype, self.path)

        return place(convert)


def refuse_narrowing(wanted: "Iterable[tuple[StoredLeaf, Any]]", doing: str) -> None:
    """Raise `CastError` naming every leaf JAX would silently narrow when read into its
    target (None: as saved): 64-bit data with x64 off. ``doing`` starts the message."""
    import jax

    if jax.config.read("jax_enable_x64"):  # once, not once per leaf
        return
    changed = [(leaf.path, why) for leaf, target in wanted if (why := leaf.narrowed(target)) is not None]
    if changed:
        raise CastError(
            f"{doing}: {len(changed)} leaves would change: "
            + "; ".join(f"{path}: {why}" for path, why in changed[:MAX_LISTED])
            + ("; ..." if len(changed) > MAX_LISTED else "")
            + "."
        )


def check_bool_bytes(data: np.ndarray, path: str) -> None:
    """A bool array whose bytes are not all 0 or 1 is damaged: numpy shows such a byte as
    True, but XLA computes with the byte itself (``x & True`` can be False)."""
    if data.dtype == np.bool_ and data.size and data.view(np.uint8).max() > 1:
        raise CorruptCheckpointError(
            f"Leaf {path!r}: its bool data holds bytes other than 0 and 1 (largest {data.view(np.uint8).max()}), "
            "which no writer of bools produces. The checkpoint is damaged or crafted.",
            leaf_path=path,
        )


@functools.cache
def key_dtype(impl: str) -> Any:
    """The dtype of typed PRNG keys of ``impl`` (``key<fry>`` for threefry2x32)."""
    import jax

    try:
        return jax.random.key(0, impl=impl).dtype
    except ValueError:
        raise ManifestError(f"The manifest names a PRNG implementation this JAX does not know: {impl!r}.") from None


@dataclasses.dataclass(frozen=True)
class KeyLeaf(StoredLeaf):
    """A typed PRNG key array, stored as its key data.

    **Attributes:** as a `StoredLeaf`'s (`shape` is the keys', `dtype` their key data's),
    and `impl`, the name of its PRNG implementation; `key_shape`, the trailing dimensions
    each key's data has.

    ```python
    eqxckpt.save("keys", {"key": jax.random.key(0)})
    leaf = eqxckpt.open("keys").leaf("key")
    leaf.impl, leaf.key_shape, leaf.describe()  # ('threefry2x32', (2,), 'key<threefry2x32>[]')
    ```
    """

    impl: str = ""
    key_shape: tuple[int, ...] = ()
    kind: ClassVar[str] = "prng_key"
    sliceable: ClassVar[bool] = False

    @property
    def data_shape(self) -> tuple[int, ...]:
        return self.shape + self.key_shape

    @property
    def value_dtype(self) -> np.dtype:
        return key_dtype(self.impl)

    def describe(self) -> str:
        return f"key<{self.impl}>[{','.join(map(str, self.shape))}]"

    def digest_fields(self) -> list[Any]:
        return [*super().digest_fields(), self.impl]

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "impl": self.impl, "key_shape": list(self.key_shape)}

    @classmethod
    def from_json(cls, doc: dict[str, Any], path: str, keys: tuple[KeyRecord, ...]) -> "KeyLeaf":
        shape, dtype, fields = cls._stored(doc, path)
        impl = doc.get("impl")
        if not isinstance(impl, str) or not impl.isidentifier():
            raise ManifestError(f"Leaf {path!r}: PRNG impl {impl!r} is not a name.")
        return cls(path, keys, shape, dtype, impl, parse_shape(doc.get("key_shape"), path), **fields)

    def mismatch(self, target: Any, cast: bool) -> str | None:
        if not is_array_like(target) or not is_prng_key_dtype(target.dtype) or key_dtype(self.impl) != target.dtype:
            return self._differs(target)
        if tuple(np.shape(target)) != self.shape:
            return self._differs(target)
        return self.unheld(target)

    def can_shard(self, sharding: "jax.sharding.Sharding") -> bool:
        # Key data has trailing dimensions; only a NamedSharding says how to lay those out.
        import jax

        return isinstance(sharding, jax.sharding.NamedSharding)

    def check_known(self) -> None:
        key_dtype(self.impl)

    def host_value(self, data: np.ndarray, dtype: np.dtype | None) -> Any:
        return self.wrap(data)

    def selection_nbytes(self, shape: tuple[int, ...], dtype: np.dtype) -> int:
        return self.nbytes

    def copied(
        self, path: str, keys: tuple[KeyRecord, ...], shape: tuple[int, ...], dtype: np.dtype, *, changed: bool
    ) -> "KeyLeaf":
        if changed:
            raise UnsupportedLeafError(
                f"Leaf {path!r}: a sliced or cast lazy PRNG key array cannot be saved; get() it."
            )
        return dataclasses.replace(self, path=path, keys=keys, offset=None)  # written as its own array

    def wrap(self, data: Any) -> "jax.Array":
        """Typed PRNG keys are stored as key data; turn them back into keys."""
        import jax

        key_dtype(self.impl)  # a clear error for an unknown implementation
        try:
            return jax.random.wrap_key_data(data, impl=self.impl)
        except (ValueError, TypeError) as e:
            raise CorruptCheckpointError(
                f"Leaf {self.path!r}: its stored key data {data.shape} does not fit PRNG implementation "
                f"{self.impl!r} ({e}). The checkpoint is damaged or was edited.",
                leaf_path=self.path,
            ) from None

    def finish(self, data: np.ndarray, target: Any, adoptions: "Adoptions | None" = None) -> Any:
        import jax

        value = self.wrap(data)
        sharding = getattr(target, "sharding", None)
        return value if sharding is None else jax.device_put(value, sharding)

    def placement(self, target: Any) -> "tuple[jax.sharding.Sharding, np.dtype] | None":
        import jax

        sharding = getattr(target, "sharding", None)
        if sharding is None:
            device = default_device()
            if device is None:
                return None
            sharding = jax.sharding.SingleDeviceSharding(device)
        return sharding, np.dtype(self.dtype)

    def assemble(self, target: Any, place: Any) -> "jax.Array":
        import jax

        key_dtype(self.impl)  # a clear error for an unknown implementation
        return jax.random.wrap_key_data(place(lambda data: data), impl=self.impl)


@dataclasses.dataclass(frozen=True)
class ScalarLeaf(Leaf):
    """A Python scalar, string or None, kept in the manifest (bit for bit, NaNs' too).

    **Attributes:** `type_name`: ``int``, ``float``, ``bool``, ``complex``, ``str`` or
    ``none``. Its value is ``value()``.

    ```python
    step = eqxckpt.open("checkpoints/step_100").leaf("step")
    step.type_name, step.value()  # ('int', 0)
    ```
    """

    type_name: str = "none"
    json_value: Any = None
    bits: Any = None
    kind: ClassVar[str] = "scalar"

    @classmethod
    def of(cls, path: str, keys: tuple[KeyRecord, ...], value: Any) -> "ScalarLeaf":
        """The leaf of a Python scalar, string or None, bit for bit; `UnsupportedLeafError`
        for an int with more digits than Python converts to and from text (JSON) by default:
        a process that raised its own limit could save what no other process loads."""
        if isinstance(value, int) and not isinstance(value, bool):
            limit = sys.int_info.default_max_str_digits
            try:
                digits = len(str(abs(value)))
            except ValueError:
                digits = None
            if digits is None or (limit and digits > limit):
                raise UnsupportedLeafError(
                    f"Leaf {path!r}: an int of about {int(value.bit_length() * 0.30103)} digits, more than Python "
                    f"reads from or writes to JSON by default ({limit}): it could be saved but not loaded where "
                    "the default holds. Save it as a str, or as a numpy array of its bytes."
                ) from None
        return cls(path, keys, *scalar_to_json(value), nan_bits(value))

    def describe(self) -> str:
        return f"{self.type_name} = {self.value()!r}"

    def _fields(self) -> dict[str, Any]:
        fields = {"type": self.type_name, "value": self.json_value}
        return fields if self.bits is None else {**fields, "bits": self.bits}

    @classmethod
    def from_json(cls, doc: dict[str, Any], path: str, keys: tuple[KeyRecord, ...]) -> "ScalarLeaf":
        type_name = _type_name(doc, path)
        if type_name not in SCALAR_NAMES:
            raise ManifestError(f"Leaf {path!r}: unknown scalar type {type_name!r}.")
        value = scalar_from_json(type_name, doc.get("value"))  # validates
        bits = doc.get("bits")
        if bits is not None and not bits_fit(value, bits):
            raise ManifestError(
                f"Leaf {path!r}: its bits {bits!r} are not those of a NaN other than float('nan') where its "
                f"{type_name} value {doc.get('value')!r} has one. The checkpoint is damaged or crafted."
            )
        return cls(path, keys, type_name, doc.get("value"), bits)

    def mismatch(self, target: Any, cast: bool) -> str | None:
        if is_array_like(target) or not isinstance(target, SCALAR_TYPES) or self.type_name != scalar_to_json(target)[0]:
            return self._differs(target)
        if _as_like(self.value(), target) is None and (isinstance(target, enum.Enum) or isinstance(target, np.str_)):
            return f"{self.describe()} is no member of {type(target).__qualname__}, which `like` holds"
        return None

    def value(self, target: Any = None) -> Any:
        """The value, bit for bit as it was saved; of ``target``'s type where that is an
        enum of ints or strs that holds it (an `IntEnum`, a `(str, Enum)`), or `np.str_`.

        **Returns:** the int, float, bool, complex, str or None.

        ```python
        eqxckpt.open("checkpoints/step_100").leaf("step").value()  # 0
        ```
        """
        value = scalar_from_json(self.type_name, self.json_value)
        value = value if self.bits is None else with_bits(value, self.bits)
        kept = _as_like(value, target)
        return value if kept is None else kept

    @property
    def is_none(self) -> bool:
        return self.type_name == "none"


def _as_like(value: Any, target: Any) -> Any:
    """``value`` (an int or str) as ``target``'s type, where that is an enum of ints or strs
    or an `np.str_`, and holds exactly ``value`` (an enum's ``_missing_`` may map a value to
    another member: that is no member); None otherwise."""
    if type(value) not in (int, str) or not isinstance(target, type(value)):
        return None
    if not isinstance(target, (enum.Enum, np.str_)):
        return None
    try:
        kept = type(target)(value)
    except Exception:  # noqa: BLE001 - a user's enum may raise anything for a non-member
        return None
    held = kept.value if isinstance(kept, enum.Enum) else str(kept)
    return kept if type(held) is type(value) and held == value else None


@dataclasses.dataclass(frozen=True)
class OpaqueLeaf(Leaf):
    """A function, a class, or an object holding no data: only what it is called is
    kept; `load` takes the value from `like`.

    **Attributes:** `type_name`, its type's qualified name; `name`, the function's or
    class's qualified name (``""`` if it has none).

    ```python
    eqxckpt.open("checkpoints/step_100").leaf("model/activation").describe()  # <function ...relu>
    ```
    """

    type_name: str = ""
    name: str = ""  # what the function or class is called (``jax._src.nn.functions.relu``); "" if unknown
    kind: ClassVar[str] = "opaque"

    def describe(self) -> str:
        if not self.name:
            return f"<{self.type_name}>"
        return f"<{'class' if self.type_name.endswith(('type', 'Meta')) else 'function'} {self.name}>"

    def _fields(self) -> dict[str, Any]:
        return {"type": self.type_name, **({"name": self.name} if self.name else {})}

    @classmethod
    def from_json(cls, doc: dict[str, Any], path: str, keys: tuple[KeyRecord, ...]) -> "OpaqueLeaf":
        name = doc.get("name", "")
        if not isinstance(name, str) or len(name) > 1000:
            raise ManifestError(f"Leaf {path!r}: 'name' must be a string of at most 1000 characters.")
        return cls(path, keys, _type_name(doc, path), name)

    def mismatch(self, target: Any, cast: bool) -> str | None:
        return self._differs(target) if is_array_like(target) or isinstance(target, SCALAR_TYPES) else None

    def value(self, target: Any = None) -> Any:
        return target


KINDS: dict[str, type[Leaf]] = {cls.kind: cls for cls in (ArrayLeaf, KeyLeaf, ScalarLeaf, OpaqueLeaf)}


def _type_name(doc: dict[str, Any], path: str) -> str:
    type_name = doc.get("type")
    if not isinstance(type_name, str) or len(type_name) > 1000:
        raise ManifestError(f"Leaf {path!r}: 'type' must be a string.")
    return type_name


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


def parse_leaf(doc: Any, keys_of: Any) -> Leaf:
    """One manifest entry as its kind's `Leaf`; ``keys_of(value, path)`` validates its keys."""
    if not isinstance(doc, dict):
        raise ManifestError(f"A manifest leaf must be an object, found {type(doc).__name__}.")
    path = validate_path(doc.get("path"))
    kind = doc.get("kind")
    if not isinstance(kind, str) or kind not in KINDS:
        raise ManifestError(f"Leaf {path!r}: unknown kind {kind!r} (expected one of {tuple(KINDS)}).")
    return KINDS[kind].from_json(doc, path, keys_of(doc.get("keys"), path))
