"""Flattening pytrees into path-named leaves, and telling leaf kinds apart."""

import collections
import collections.abc
import functools
import inspect
import numbers
from typing import Any

import numpy as np

from ._errors import MAX_LISTED, ArgumentError, ManifestError
from ._paths import check_unique, keypath_to_path

SCALAR_TYPES = (bool, int, float, complex, str)


def flatten(tree: Any, empty_in_sequences: bool = False) -> tuple[list[tuple[str, tuple, Any]], Any]:
    """``([(path, keypath, leaf), ...], treedef)``; paths checked for collisions.

    ``empty_in_sequences``: an empty subtree (None, ``()``, optax's
    ``EmptyState()``) that is an element of a list or tuple (or of a pytree
    registered without keys, whose children are numbered) becomes a leaf too,
    so that every sequence has a leaf at each index (for saving).

    ```python
    flatten({"a": 1, "b": [2.0]})[0]  # [('a', (DictKey('a'),), 1), ('b/0', ..., 2.0)]
    ```
    """
    import jax.tree_util as jtu

    try:
        if empty_in_sequences:
            with_path, _ = jtu.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree and is_empty_subtree(x))
            with_path = [
                (kp, leaf)
                for kp, leaf in with_path
                # (a pytree registered without keys flattens to indices, read back as a sequence)
                if not is_empty_subtree(leaf) or isinstance(kp[-1], (jtu.SequenceKey, jtu.FlattenedIndexKey))
            ]
            treedef = jtu.tree_structure(tree)
        else:
            with_path, treedef = jtu.tree_flatten_with_path(tree)
    except (ValueError, TypeError) as e:  # a defaultdict's keys fail with a TypeError
        if (unsorted := _unsortable_dict(tree)) is None:
            raise
        where, keys = unsorted
        raise ArgumentError(
            f"The dict at {where or '<root>'} has keys JAX cannot put in order ({', '.join(keys)}): it sorts a "
            "dict's keys to flatten it, and these do not compare with each other. Use keys of one type (all "
            "strings, say)."
        ) from e
    flat = [(keypath_to_path(kp), kp, leaf) for kp, leaf in with_path]
    check_unique([(path, kp) for path, kp, _ in flat])
    return flat, treedef


def _unsortable_dict(tree: Any) -> tuple[str, list[str]] | None:
    """Where in ``tree`` a dict's keys cannot be sorted (what JAX's flattening needs), and a
    few of them; None if none is."""
    import jax.tree_util as jtu

    def unsortable(x: Any) -> bool:
        # Only the dicts JAX sorts: it keeps an OrderedDict's order, and a subclass is a leaf.
        if type(x) not in (dict, collections.defaultdict):
            return False
        try:
            sorted(x)
        except TypeError:
            return True
        return False

    try:
        found = jtu.tree_flatten_with_path(tree, is_leaf=unsortable)[0]
    except ValueError:
        return None
    for keypath, leaf in found:
        if unsortable(leaf):
            return jtu.keystr(keypath), [repr(k) for k in list(leaf)[:MAX_LISTED]]
    return None


def is_prng_key_dtype(dtype: Any) -> bool:
    if dtype is None:
        return False
    try:
        return _is_key_dtype(dtype)
    except TypeError:  # unhashable: asked directly
        return _is_key_dtype.__wrapped__(dtype)


@functools.lru_cache(maxsize=256)  # asked per leaf; trees hold a few dtypes
def _is_key_dtype(dtype: Any) -> bool:
    import jax

    return bool(jax.numpy.issubdtype(dtype, jax.dtypes.prng_key))


def is_array_like(x: Any) -> bool:
    """Arrays and array skeletons: anything with a shape and a dtype to restore into."""
    by_type = _array_like_type(type(x))
    if by_type is not None:
        return by_type
    import jax

    return isinstance(x, jax.Array)  # a tracer: an array or not by its aval (a token is not)


@functools.lru_cache(maxsize=1024)  # asked per leaf of a tree; the type decides, but for tracers
def _array_like_type(kind: type) -> bool | None:
    """Whether instances of ``kind`` are array-like; None where each instance decides
    (JAX's tracers are instances of jax.Array by their aval, without being a subclass)."""
    import jax

    if issubclass(kind, (np.str_, np.bytes_)):
        return False
    if issubclass(kind, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)):
        return True
    return None if hasattr(kind, "aval") else False


def describe_like(x: Any) -> str:
    """``float32[4,3]`` for arrays and skeletons, the type name otherwise."""
    import jax

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
    import jax

    if isinstance(x, (type, np.dtype)) or inspect.isroutine(x):
        return True
    if isinstance(x, functools.partial):
        arguments = jax.tree_util.tree_leaves((x.args, x.keywords))
        return is_code(x.func) and not any(is_array_like(a) for a in arguments)
    module = type(x).__module__.split(".")[0]
    return callable(x) and module in ("jax", "jaxlib", "equinox")


# Types whose instances hold data even with no attributes: containers, buffers, numbers.
_HOLDS_DATA = (
    collections.abc.Iterable,
    collections.abc.Sized,
    collections.abc.Container,
    numbers.Number,
    bytes,
    bytearray,
    memoryview,
)


def holds_no_data(x: Any) -> bool:
    """Whether ``x`` is an object that provably holds no data: a plain instance with no
    attributes at all (``object()``, Equinox's ``SharedNode`` placeholder of a tied
    weight), of a class that is no container, number or buffer. `save` records such
    a leaf by its type and `load` takes it from `like`; anything with state is refused.
    """
    if isinstance(x, _HOLDS_DATA) or is_array_like(x) or is_code(x):
        return False
    cls = type(x)
    if cls is object:
        return True
    # A Python class's instance: its state is its __dict__ and slots. Objects of C types,
    # which keep state where this cannot see, have neither and are refused.
    state = getattr(x, "__dict__", None)
    if state is None and not all("__slots__" in klass.__dict__ for klass in cls.__mro__[:-1]):
        return False
    if state is not None and (not isinstance(state, dict) or state):
        return False
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(x, name):
                return False
    # Classes that keep state elsewhere say how to rebuild it.
    return cls.__reduce_ex__ is object.__reduce_ex__ and cls.__reduce__ is object.__reduce__


# Types that are always leaves themselves (never pytree nodes): asked about per leaf of a
# large tree, they are answered without flattening.
_LEAF_TYPES = frozenset({np.ndarray, bool, int, float, complex, str})


def is_empty_subtree(x: Any) -> bool:
    """None, or a container with no leaves at all (``()``, ``{}``, optax's ``EmptyState()``)."""
    if type(x) in _LEAF_TYPES or is_array_like(x):  # arrays and skeletons are leaves themselves
        return False
    import jax.tree_util as jtu

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
            last = i == len(keys) - 1
            held = node.get(key)
            # A name that is both a leaf and a subtree (or two leaves) has no one tree: refused,
            # whichever came first, never one of them dropped.
            if key in node and (last or not isinstance(held, _Node)):
                where = "/".join(str(k[1]) for k in keys[: i + 1])
                raise ManifestError(
                    f"{where!r} is both a leaf and a subtree, or two leaves: the checkpoint's names make no one "
                    "tree. It is damaged or crafted, or its format's listing is wrong; read its leaves by path."
                )
            if last:
                node[key] = value
            else:
                node = node.setdefault(key, _Node())
    return _freeze(root)


def _freeze(node: Any, where: str = "") -> Any:
    if not isinstance(node, _Node):
        return node
    if node.kind == "list":
        # Checked before a list is allocated: a crafted index cannot make a huge one,
        # and a missing leaf cannot become a silent None.
        if node and (min(node) != 0 or max(node) != len(node) - 1):
            raise ManifestError(
                f"The sequence at {where or '<root>'!r} has items {sorted(node)[:5]}{' ...' if len(node) > 5 else ''} "
                f"(largest {max(node)}), not exactly 0..{len(node) - 1}: items are missing, so it cannot be rebuilt "
                "without code. The checkpoint is damaged or crafted; load it into a `like` that has the structure."
            )
        return [_freeze(node[index], f"{where}/{index}" if where else str(index)) for index in range(len(node))]
    return {key: _freeze(child, f"{where}/{key}" if where else str(key)) for key, child in node.items()}
