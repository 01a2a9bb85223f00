"""`KeyLeaf`: a typed JAX PRNG key array, stored as its key data."""

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from .._errors import CorruptCheckpointError, ManifestError, UnsupportedLeafError
from .._formats._convert import Adoptions, default_device
from .._tree import (
    is_array_like,
    is_prng_key_dtype,
)
from ._base import MAX_RANK, KeyRecord, StoredLeaf, parse_shape, shape_refusal

if TYPE_CHECKING:  # JAX is imported where a leaf is restored or saved, not to read a manifest
    import jax

# One key entry: ("attr" | "dict" | "seq" | "index", key) plus "repr" for keys recorded by their repr.


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
        key_shape = parse_shape(doc.get("key_shape"), path)
        if why := data_shape_refusal(shape, key_shape):
            raise ManifestError(f"Leaf {path!r}: its key data's shape {list(shape + key_shape)} {why}.")
        return cls(path, keys, shape, dtype, impl, key_shape, **fields)

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
        # Written as its own array in the new checkpoint's own prefix: nothing of where the
        # source held it (a sibling's prefix, what was seen there, a part's blocks) carries over.
        return dataclasses.replace(self, path=path, keys=keys, offset=None, arrays=None, seen=None, blocks=None)

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


def data_shape_refusal(shape: tuple[int, ...], key_shape: tuple[int, ...]) -> str | None:
    """Why a reader refuses a key array of ``shape`` whose keys' data is ``key_shape``
    each (each checked alone), or None: their data together must be an array too."""
    if len(shape) + len(key_shape) > MAX_RANK:
        return f"has more than {MAX_RANK} dimensions"
    return shape_refusal(shape + key_shape)
