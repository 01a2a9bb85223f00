"""`HostShards`: what one process holds of a pytree, in its host memory, and the pytree
rebuilt from it onto the same devices.

A local tier's piece is one process's part of a step: each array leaf's shards that
this process can address (one copy of each distinct block), its host leaves whole, and
its Python scalars. It is all that process needs to restore the step onto the devices
it held it on, without any other process's data.
"""

import dataclasses
from typing import Any

import jax
import numpy as np
from jaxtyping import PyTree

from .._dtypes import check_dtype, dtype_name, little_endian
from .._errors import StructureMismatchError, UnsupportedLeafError
from .._pieces import host_array
from .._tree import is_prng_key_dtype

# A block of an array: (start, stop) on each axis.
Box = tuple[tuple[int, int], ...]


def box_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> Box:
    """The block a shard's ``index`` (slices, as `jax.Shard.index` gives) selects of ``shape``."""
    out = []
    for part, size in zip(index, shape):
        start, stop, step = part.indices(size)
        assert step == 1, "shards are contiguous blocks"
        out.append((start, stop))
    return tuple(out) + tuple((0, size) for size in shape[len(index) :])


def _inside(inner: Box, outer: Box) -> bool:
    return all(o0 <= i0 and i1 <= o1 for (i0, i1), (o0, o1) in zip(inner, outer))


def _python_value(value: Any) -> dict | None:
    """A Python scalar leaf as JSON that gives back the same value and type, or None."""
    if isinstance(value, bool):
        return {"type": "bool", "value": value}
    if isinstance(value, int):
        return {"type": "int", "value": str(value)}  # any size, exactly
    if isinstance(value, float):
        return {"type": "float", "value": value.hex()}  # every bit, NaN and infinities too
    if isinstance(value, complex):
        return {"type": "complex", "value": [value.real.hex(), value.imag.hex()]}
    if isinstance(value, str):
        return {"type": "str", "value": value}
    return None


def _from_python(record: dict) -> Any:
    kind, value = record["type"], record["value"]
    if kind == "complex":
        return complex(float.fromhex(value[0]), float.fromhex(value[1]))
    return {"bool": bool, "int": int, "float": float.fromhex, "str": str}[kind](value)


@dataclasses.dataclass
class HostShards:
    """One process's part of a pytree, in host memory: ``leaves`` describes each leaf (JSON,
    stored in the piece's metadata) and ``arrays`` holds the blocks it names by position.

    ```python
    part = HostShards.take(state)                  # on the caller's thread: host copies
    state = part.rebuild(eqx.filter_eval_shape(make_state))
    ```
    """

    leaves: list[dict]
    arrays: list[np.ndarray]

    @classmethod
    def take(cls, tree: PyTree) -> "HostShards":
        """This process's part of ``tree``, in host memory nothing else changes: the
        caller may donate, delete or mutate its arrays afterwards.

        **Arguments:**

        - `tree`: a pytree of JAX arrays (sharded or not), numpy arrays, Python scalars
          and other leaves (functions), as `eqxckpt.save` takes.

        **Returns:** a `HostShards`. Other leaves (not arrays or scalars) are recorded by
        path alone and taken from ``like`` when rebuilt.

        ```python
        part = HostShards.take({"w": jnp.ones(3), "step": 7})
        ```
        """
        leaves: list[dict] = []
        blocks: list[Any] = []
        for keypath, value in jax.tree_util.tree_flatten_with_path(tree)[0]:
            path = jax.tree_util.keystr(keypath)
            if isinstance(value, jax.Array):
                impl = str(jax.random.key_impl(value)) if is_prng_key_dtype(value.dtype) else None
                if impl is None:
                    check_dtype(np.dtype(value.dtype), path)
                shape = tuple(value.shape)
                shards: dict[Box, int] = {}
                for shard in value.addressable_shards:
                    box = box_of(shard.index, shape)
                    if box not in shards:
                        shards[box] = len(blocks)
                        blocks.append(jax.random.key_data(shard.data) if impl else shard.data)
                dtype = "key" if impl else dtype_name(value.dtype)
                leaves.append(
                    {
                        "path": path,
                        "kind": "array",
                        "shape": list(shape),
                        "dtype": dtype,
                        "impl": impl,
                        "shards": [[[list(b) for b in box], at] for box, at in shards.items()],
                    }
                )
            elif isinstance(value, (np.ndarray, np.generic)):
                if value.dtype.hasobject or isinstance(value, np.ma.MaskedArray):
                    raise UnsupportedLeafError(
                        f"Leaf {path}: the local tier stores numeric arrays, got a {type(value).__name__} of "
                        f"{value.dtype}. Keep such leaves out of the saved tree (eqx.filter(tree, eqx.is_array))."
                    )
                check_dtype(value.dtype, path)
                leaves.append(
                    {"path": path, "kind": "host", "scalar": isinstance(value, np.generic), "at": len(blocks)}
                )
                blocks.append(little_endian(value, copy=True))  # numpy arrays are mutable: a copy of its own
            elif (python := _python_value(value)) is not None:
                leaves.append({"path": path, "kind": "python", **python})
            else:
                leaves.append({"path": path, "kind": "like"})
        # Every device-to-host copy started before any is waited for (a no-op on CPU).
        for block in blocks:
            if isinstance(block, jax.Array):
                block.copy_to_host_async()
        arrays = [host_array(b, copy=False) if isinstance(b, jax.Array) else b for b in blocks]
        return cls(leaves, arrays)

    @property
    def nbytes(self) -> int:
        """The bytes of its arrays."""
        return sum(a.nbytes for a in self.arrays)

    def rebuild(self, like: PyTree) -> PyTree:
        """The pytree ``like`` describes, from this part: each array leaf placed as
        ``like``'s sharding says (a `jax.ShapeDtypeStruct` or array with a sharding; none:
        the default device), each block taken from a stored block that holds it.

        **Arguments:**

        - `like`: the structure, shapes, dtypes and shardings to restore (as for `eqxckpt.load`).

        **Returns:** the restored pytree. Raises `StructureMismatchError` naming every leaf
        whose path, shape or dtype differs, or whose blocks this part does not hold (a
        different mesh than the one saved from).

        ```python
        state = part.rebuild(eqx.filter_eval_shape(make_state))
        ```
        """
        flat, treedef = jax.tree_util.tree_flatten_with_path(like)
        stored = {leaf["path"]: leaf for leaf in self.leaves}
        wanted = {jax.tree_util.keystr(keypath) for keypath, _ in flat}
        missing = [(p, "not in the local tier's copy") for p in sorted(wanted - stored.keys())]
        unexpected = [(p, "stored but not in like") for p in sorted(stored.keys() - wanted)]
        mismatched: list[tuple[str, str]] = []
        out = []
        for keypath, target in flat:
            path = jax.tree_util.keystr(keypath)
            record = stored.get(path)
            if record is None:
                out.append(target)
                continue
            try:
                out.append(self._leaf(record, target))
            except _Mismatch as e:
                mismatched.append((path, str(e)))
                out.append(target)
        if missing or unexpected or mismatched:
            lines = [f"  {p}: {what}" for p, what in [*missing, *unexpected, *mismatched]]
            raise StructureMismatchError(
                "The local tier's copy does not fit like:\n" + "\n".join(lines[:20]) + "\nRestore from the "
                "persistent tier (CheckpointManager.load(step=...) of a persistent step) onto a different structure "
                "or mesh.",
                missing=missing,
                unexpected=unexpected,
                mismatched=mismatched,
            )
        return treedef.unflatten(out)

    def _leaf(self, record: dict, target: Any) -> Any:
        kind = record["kind"]
        if kind == "python":
            value = _from_python(record)
            if type(target) is not type(value) and not isinstance(target, jax.ShapeDtypeStruct):
                raise _Mismatch(f"stored a Python {record['type']}, like has {type(target).__name__}")
            return value
        if kind == "like":
            return target
        if kind == "host":
            value = self.arrays[record["at"]]
            shape, dtype = getattr(target, "shape", None), getattr(target, "dtype", None)
            if shape is None or tuple(shape) != value.shape or np.dtype(dtype) != value.dtype:
                raise _Mismatch(f"stored {value.dtype}{list(value.shape)}, like has {dtype}{list(shape or [])}")
            if isinstance(target, (np.ndarray, np.generic)):
                return value[()] if record["scalar"] else value
            return self._placed([((tuple((0, n) for n in value.shape)), value)], value.shape, None, target)
        shape = tuple(record["shape"])
        target_shape = getattr(target, "shape", None)
        if target_shape is None or tuple(target_shape) != shape:
            raise _Mismatch(f"stored shape {shape}, like has {target_shape}")
        impl = record["impl"]
        target_dtype = getattr(target, "dtype", None)
        if impl is not None:
            if target_dtype is None or not is_prng_key_dtype(target_dtype):
                raise _Mismatch(f"stored PRNG keys ({impl}), like has dtype {target_dtype}")
        elif target_dtype is None or np.dtype(target_dtype) != np.dtype(record["dtype"]):
            raise _Mismatch(f"stored dtype {np.dtype(record['dtype'])}, like has {target_dtype}")
        blocks = [(tuple(tuple(b) for b in box), self.arrays[at]) for box, at in record["shards"]]
        if isinstance(target, np.ndarray):  # a host array is asked for: the whole of it, here
            whole = next((data for box, data in blocks if box == tuple((0, n) for n in shape)), None)
            if whole is None or impl is not None:
                raise _Mismatch("like asks for a numpy array; this process holds only blocks of it")
            return whole
        return self._placed(blocks, shape, impl, target)

    def _placed(self, blocks: list[tuple[Box, np.ndarray]], shape: tuple[int, ...], impl: str | None, target: Any):
        """The array ``target`` describes, each of this process's blocks from a stored block."""
        sharding = getattr(target, "sharding", None)
        if sharding is None:
            sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        singles = []
        for device, index in sharding.addressable_devices_indices_map(shape).items():
            box = box_of(tuple(index), shape)  # type: ignore[arg-type]  # slices, for a sharding's devices
            held = next(((b, data) for b, data in blocks if _inside(box, b)), None)
            if held is None:
                raise _Mismatch(f"block {list(box)} is not among the blocks stored ({[list(b) for b, _ in blocks]})")
            outer, data = held
            part = data[tuple(slice(i0 - o0, i1 - o0) for (i0, i1), (o0, _) in zip(box, outer))]
            single = jax.device_put(part, device)
            singles.append(jax.random.wrap_key_data(single, impl=impl) if impl else single)
        if isinstance(sharding, jax.sharding.SingleDeviceSharding) and len(singles) == 1:
            return singles[0]
        return jax.make_array_from_single_device_arrays(shape, sharding, singles)


class _Mismatch(Exception):
    pass
