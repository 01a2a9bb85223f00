"""`leaf_of`: which kind of leaf (`_leaf`) a value being saved becomes, and the array
stored for it; or why it cannot be saved faithfully, and what to do instead."""

from typing import Any

import numpy as np

from ._dtypes import check_dtype
from ._errors import UnsupportedLeafError
from ._leaf import MAX_RANK, ArrayLeaf, KeyLeaf, KeyRecord, Leaf, OpaqueLeaf, ScalarLeaf, shape_refusal
from ._tree import (
    SCALAR_TYPES,
    code_name,
    holds_no_data,
    is_array_like,
    is_code,
    is_empty_subtree,
    is_prng_key_dtype,
    type_name,
)


def leaf_of(path: str, keys: tuple[KeyRecord, ...], value: Any) -> tuple[Leaf, Any]:
    """The leaf a saved ``value`` becomes, and the array to store for it (None: nothing stored).

    Raises `UnsupportedLeafError` for what cannot be stored faithfully.
    """
    import jax

    if is_array_like(value) and not isinstance(value, (jax.ShapeDtypeStruct, np.ma.MaskedArray)):
        if (why := shape_refusal(value.shape)) or len(value.shape) > MAX_RANK:
            raise UnsupportedLeafError(
                f"Leaf {path!r}: its shape {tuple(value.shape)} "
                + (why or f"has more than {MAX_RANK} dimensions")
                + ": a load would refuse it, so it is not saved. Reshape it, or keep it out of the saved tree."
            )
        if isinstance(value, jax.Array) and is_prng_key_dtype(value.dtype):
            data = jax.random.key_data(value)
            leaf = KeyLeaf(
                path,
                keys,
                tuple(value.shape),
                np.dtype(data.dtype).name,
                str(jax.random.key_impl(value)),
                tuple(data.shape[value.ndim :]),
            )
            return leaf, data
        array_type = (
            "jax" if isinstance(value, jax.Array) else "numpy" if isinstance(value, np.ndarray) else "numpy_scalar"
        )
        return ArrayLeaf(path, keys, tuple(value.shape), _stored_name(value.dtype, path), array_type), value
    if isinstance(value, SCALAR_TYPES) or is_empty_subtree(value):
        # An empty subtree in a sequence is recorded as None: it keeps the indices whole.
        scalar = None if is_empty_subtree(value) else str(value) if isinstance(value, np.str_) else value
        return ScalarLeaf.of(path, keys, scalar), None
    if is_code(value) or holds_no_data(value):
        return OpaqueLeaf.of(path, keys, type_name(value), code_name(value)), None
    raise UnsupportedLeafError(_refusal(path, value))


# The names of the dtypes `check_dtype` has passed, by the dtype objects arrays report:
# a tree of many leaves holds a few dtypes, each checked and named once.
_CHECKED: dict[Any, str] = {}


def _stored_name(dtype: Any, path: str) -> str:
    """The name of a (non-key) array dtype that checkpoints store; raises `check_dtype`'s
    error for others."""
    name = _CHECKED.get(dtype)
    if name is None:
        checked = np.dtype(dtype)
        check_dtype(checked, path)
        name = _CHECKED[dtype] = checked.name
    return name


def _refusal(path: str, leaf: Any) -> str:
    """Why a leaf cannot be saved, and what to do instead."""
    import jax

    kind = type_name(leaf)
    if isinstance(leaf, np.ma.MaskedArray):
        return (
            f"Leaf {path!r} is a numpy masked array: saving it as an array would lose its mask. Save "
            f"{{'data': x.data, 'mask': np.ma.getmaskarray(x)}} instead, or np.ma.filled(x) if the mask is not needed."
        )
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return (
            f"Leaf {path!r} is a jax.ShapeDtypeStruct: a shape and dtype with no data (from eval_shape or "
            "filter_eval_shape?). Save the real arrays."
        )
    if isinstance(leaf, dict):
        hint = "a dict subclass, which JAX does not flatten: convert it with dict(x), or register it as a pytree"
    else:
        hint = "an object JAX treats as a single leaf, so eqxckpt cannot see what it holds (it may hold arrays)"
    return (
        f"Leaf {path!r} is {hint} ({kind}). Make it a pytree (an eqx.Module, a registered class "
        "(jax.tree_util.register_pytree_node / register_dataclass), or plain dicts and lists), convert it to "
        "arrays and scalars, or keep it out of the saved tree (an eqx.field(static=True), or "
        "eqx.filter(tree, eqx.is_array)). Only arrays, scalars, strings, None, functions, classes and objects "
        "with no attributes at all can be leaves."
    )
