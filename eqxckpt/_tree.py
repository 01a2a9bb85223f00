"""Flattening pytrees into path-named leaves, and telling leaf kinds apart."""

import functools
import inspect
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np

from ._paths import check_unique, keypath_to_path

SCALAR_TYPES = (bool, int, float, complex, str)


def flatten(tree: Any, empty_in_sequences: bool = False) -> tuple[list[tuple[str, tuple, Any]], Any]:
    """``([(path, keypath, leaf), ...], treedef)``; paths checked for collisions.

    ``empty_in_sequences``: an empty subtree (None, ``()``, optax's
    ``EmptyState()``) that is an element of a list or tuple becomes a leaf too,
    so that every sequence has a leaf at each index (for saving).

    ```python
    flatten({"a": 1, "b": [2.0]})[0]  # [('a', (DictKey('a'),), 1), ('b/0', ..., 2.0)]
    ```
    """
    if empty_in_sequences:
        with_path, _ = jtu.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree and is_empty_subtree(x))
        with_path = [
            (kp, leaf) for kp, leaf in with_path if not is_empty_subtree(leaf) or isinstance(kp[-1], jtu.SequenceKey)
        ]
        treedef = jtu.tree_structure(tree)
    else:
        with_path, treedef = jtu.tree_flatten_with_path(tree)
    flat = [(keypath_to_path(kp), kp, leaf) for kp, leaf in with_path]
    check_unique([(path, kp) for path, kp, _ in flat])
    return flat, treedef


def is_prng_key_dtype(dtype: Any) -> bool:
    return dtype is not None and jax.numpy.issubdtype(dtype, jax.dtypes.prng_key)


def is_array_like(x: Any) -> bool:
    """Arrays and array skeletons: anything with a shape and a dtype to restore into."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)) and not isinstance(
        x, (np.str_, np.bytes_)
    )


def describe_like(x: Any) -> str:
    """``float32[4,3]`` for arrays and skeletons, the type name otherwise."""
    if is_array_like(x):
        dtype = x.dtype
        name = (
            f"key<{jax.random.key_impl(x) if isinstance(x, jax.Array) else 'prng'}>"
            if is_prng_key_dtype(dtype)
            else np.dtype(dtype).name
        )
        return f"{name}[{','.join(map(str, np.shape(x)))}]"
    if isinstance(x, SCALAR_TYPES) or x is None:
        return f"{type(x).__name__} = {x!r}"
    return f"<{type_name(x)}>"


def type_name(x: Any) -> str:
    t = type(x)
    return f"{t.__module__}.{t.__qualname__}"


def code_name(x: Any) -> str:
    """A function's or class's name, module included (``jax._src.nn.functions.relu``;
    ``partial(...)`` around a partial's function); "" for what has none."""
    if isinstance(x, functools.partial):
        inner = code_name(x.func)
        return f"partial({inner})" if inner else ""
    name = getattr(x, "__qualname__", None) or getattr(x, "__name__", None)
    module = getattr(x, "__module__", None)
    if not isinstance(name, str):
        return str(x) if isinstance(x, np.dtype) else ""
    return f"{module}.{name}" if isinstance(module, str) else name


def is_code(x: Any) -> bool:
    """Functions and classes: leaves a checkpoint records by type only, taking
    their value from `like` on load. Everything else that is not an array, a
    scalar, a string or None is refused by `save` (it may hold data).

    The set: classes (``type`` instances, including ``jnp.float32``), numpy
    dtypes, Python functions, builtins and methods, ``functools.partial`` of
    such without array arguments, and callables defined by JAX or Equinox
    (``jax.nn.relu``, ``jax.jit(f)``).
    """
    if isinstance(x, (type, np.dtype)) or inspect.isroutine(x):
        return True
    if isinstance(x, functools.partial):
        arguments = jax.tree_util.tree_leaves((x.args, x.keywords))
        return is_code(x.func) and not any(is_array_like(a) for a in arguments)
    module = type(x).__module__.split(".")[0]
    return callable(x) and module in ("jax", "jaxlib", "equinox")


def is_empty_subtree(x: Any) -> bool:
    """None, or a container with no leaves at all (``()``, ``{}``, optax's ``EmptyState()``)."""
    return x is None or (not jtu.all_leaves([x]) and not jtu.tree_leaves(x))


class _Node(dict):
    """A container being rebuilt from key records; ``kind`` says dict or list."""

    kind = "dict"


def build_plain_tree(pairs: list[tuple[tuple[tuple[Any, ...], ...], Any]], depth: int) -> Any:
    """Nested dicts and lists from ``(key records, value)`` pairs, below the first
    ``depth`` keys (what `load` gives for ``like=None``)."""
    if len(pairs) == 1 and len(pairs[0][0]) == depth:
        return pairs[0][1]
    root = _Node()
    for keys, value in pairs:
        node = root
        keys = keys[depth:]
        for i, (kind, key, *_) in enumerate(keys):
            node.kind = "list" if kind in ("seq", "index") else "dict"
            if i == len(keys) - 1:
                node[key] = value
            else:
                node = node.setdefault(key, _Node())
    return _freeze(root)


def _freeze(node: Any) -> Any:
    if not isinstance(node, _Node):
        return node
    if node.kind == "list":
        out = [None] * (max(node) + 1 if node else 0)
        for index, child in node.items():
            out[index] = _freeze(child)
        return out
    return {key: _freeze(child) for key, child in node.items()}
