"""`ArrayLeaf`: a numpy or JAX array, stored as a zarr array."""

import dataclasses
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from .._dtypes import check_dtype, dtype_name
from .._errors import MAX_LISTED, CastError, CorruptCheckpointError, ManifestError
from .._formats._convert import Adoptions, adopt, checked_astype, default_device, narrowed
from .._tree import (
    is_array_like,
    is_prng_key_dtype,
)
from ._base import ARRAY_TYPES, UNKNOWN, KeyRecord, StoredLeaf

if TYPE_CHECKING:  # JAX is imported where a leaf is restored or saved, not to read a manifest
    import jax

# One key entry: ("attr" | "dict" | "seq" | "index", key) plus "repr" for keys recorded by their repr.


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
