"""Restores that change a model's layout: `Stack` (per-layer leaves into one stacked
leaf, for a scanned model) and `Unstack` (rows of a stacked leaf into per-layer leaves).

Both are planned on paths, shapes and dtypes alone (`plan_stack`, `plan_unstack`), so
`load` reports every misfit in its one error before anything is read; then the restore
engine (`_restore`) reads exactly the bytes the result needs: each layer, or each row of
a stacked leaf, once in all, and of a sharded target only this process's slices,
within the host memory budget.
"""

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._errors import TransformError
from .._leaf import ArrayLeaf, Leaf
from .._tree import describe_like, is_array_like

LAYER = "{i}"  # where a `Stack` template puts the layer index
MAX_NAMED = 8  # layers an error lists by name


@dataclasses.dataclass(frozen=True)
class Stack:
    """A `load` transform: the new leaf, whose leading axis has length N, is the stack
    over ``i`` in ``range(N)`` of the original leaves at ``original_key`` with ``{i}``
    replaced by ``i``. For a scanned model (blocks stacked with `eqx.filter_vmap` and
    run with `jax.lax.scan`) restored from per-layer weights.

    Each layer is read once, straight into the stacked result; a target sharded along
    any axis reads only this process's slices of each layer.

    **Arguments:**

    - `original_key`: the layers' path, with ``{i}`` where the layer index goes;
      backreferences (``\\1``, ``\\g<name>``) refer to the rule's regex groups.

    ```python
    eqxckpt.save("per_layer", {"blocks": [{"w": np.full(3, i, np.float32)} for i in range(4)]}, overwrite=True)
    like = {"blocks": {"w": jax.ShapeDtypeStruct((4, 3), jnp.float32)}}  # a scanned model's skeleton
    transforms = {r"blocks/(.*)": eqxckpt.Stack(r"blocks/{i}/\\1")}
    eqxckpt.load("per_layer", like, transforms=transforms)["blocks"]["w"][:, 0]  # np.array([0.0, 1.0, 2.0, 3.0])
    ```
    """

    original_key: str

    def __post_init__(self) -> None:
        if not isinstance(self.original_key, str) or LAYER not in self.original_key:
            raise TransformError(
                f"Stack({self.original_key!r}): the original key must contain {LAYER!r} where the layer index goes, "
                "e.g. Stack(r'blocks/{i}/\\1')."
            )


@dataclasses.dataclass(frozen=True)
class Unstack:
    """A `load` transform: the new leaf is row ``index`` of the stacked original leaf at
    ``original_key``. For a per-layer model restored from a scanned model's weights.

    The rows a restore needs of one stacked leaf are read together, so the stacked
    leaf is read about once in all, not once per row.

    **Arguments:**

    - `original_key`: the stacked leaf's path; backreferences refer to the rule's groups.
    - `index`: the row, an int or a backreference (``r"\\1"``) to a group holding one.

    ```python
    eqxckpt.save("stacked", {"blocks": {"w": np.arange(8.0).reshape(4, 2)}}, overwrite=True)
    like = {"blocks": [{"w": np.zeros(2)} for _ in range(4)]}  # a per-layer model's
    transforms = {r"blocks/(\\d+)/(.*)": eqxckpt.Unstack(r"blocks/\\2", index=r"\\1")}
    eqxckpt.load("stacked", like, transforms=transforms)["blocks"][3]["w"]  # np.array([6.0, 7.0])
    ```
    """

    original_key: str
    index: int | str

    def __post_init__(self) -> None:
        if not isinstance(self.original_key, str):
            raise TransformError(f"Unstack: original_key must be a string (a path), got {self.original_key!r}.")
        if isinstance(self.index, bool) or not isinstance(self.index, (int, str)):
            raise TransformError(
                f"Unstack({self.original_key!r}, index={self.index!r}): index must be an int or a backreference "
                "such as r'\\1'."
            )

    def row(self, match: re.Match, path: str) -> int:
        """The row this rule takes for the new leaf at ``path`` (matched by ``match``)."""
        if isinstance(self.index, int):
            return self.index
        try:
            text = match.expand(self.index)
        except (re.error, IndexError) as e:
            raise TransformError(
                f"Unstack index {self.index!r} cannot be applied to {path!r}: {e}. Check the backreferences against "
                "the regex's groups."
            ) from None
        try:
            if not (text.isascii() and text.isdigit()):  # int() would take "١" or " 1" too
                raise ValueError(text)
            return int(text)
        except ValueError:
            raise TransformError(
                f"Unstack index {self.index!r} gives {text!r} for {path!r}, which is not a row number."
            ) from None


def layer_keys(template: str, count: int) -> list[str]:
    """The original keys of layers ``0 .. count - 1`` of a `Stack` template."""
    return [template.replace(LAYER, str(i)) for i in range(count)]


# -- planning -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Stacked:
    """A new leaf read as the stack of ``layers``; ``leaf`` describes it as if stored so."""

    leaf: ArrayLeaf
    layers: tuple[ArrayLeaf, ...]


@dataclasses.dataclass(frozen=True)
class Row:
    """A new leaf read as row ``index`` of ``stacked``; ``leaf`` describes it as if stored so."""

    leaf: ArrayLeaf
    stacked: ArrayLeaf
    index: int


Layout = Stacked | Row


def originals(layout: Layout) -> tuple[ArrayLeaf, ...]:
    """The stored leaves a layout is read from."""
    return layout.layers if isinstance(layout, Stacked) else (layout.stacked,)


def _virtual(origin: ArrayLeaf, path: str, shape: tuple[int, ...]) -> ArrayLeaf:
    """A leaf of ``origin``'s dtype and kind at ``path`` with ``shape`` (never stored, so no digest)."""
    keys = tuple(("dict", part) for part in path.split("/"))
    return dataclasses.replace(origin, path=path, keys=keys, shape=shape, digest=None, offset=None, arrays=None)


def plan_stack(
    path: str,
    template: str,
    target: Any,
    by_key: dict[str, Leaf],
    strict: bool,
    cast: bool,
    origin: Callable[[str], str] | None = None,
) -> Stacked | str:
    """How the new leaf at ``path`` is stacked from the layers at ``template``, or why it cannot be.
    ``origin`` gives a layer's name in its format, for the message (`Source.origin`)."""
    if not is_array_like(target) or not np.shape(target):
        return f"Stack({template!r}) needs an array with a leading layer axis in `like`, found {describe_like(target)}"
    count = np.shape(target)[0]
    keys = layer_keys(template, count)
    absent = [key for key in keys if key not in by_key]
    if absent:
        return (
            f"Stack({template!r}) stacks {count} layers for {describe_like(target)}, but the checkpoint has no "
            f"{_named(absent)}"
        )
    layers = [by_key[key] for key in keys]
    odd = [(key, leaf) for key, leaf in zip(keys, layers) if not isinstance(leaf, ArrayLeaf)]
    if odd:
        return f"Stack({template!r}) stacks arrays; {', '.join(f'{k!r} is {v.describe()}' for k, v in odd[:MAX_NAMED])}"
    arrays = [leaf for leaf in layers if isinstance(leaf, ArrayLeaf)]
    # With cast=True each layer is cast to `like`'s dtype as it is read: stored dtypes may differ.
    differ = {(leaf.shape, None if cast else leaf.dtype) for leaf in arrays}
    if len(differ) > 1:
        kinds: dict[str, list[str]] = {}
        for key, leaf in zip(keys, arrays):
            kinds.setdefault(leaf.describe(), []).append(f"{key!r}" + _stored_as(leaf, key, origin))
        why = "shape" if cast else "shape or dtype"
        return f"Stack({template!r}): the layers differ in {why}: " + "; ".join(
            f"{described} at {', '.join(at[:MAX_NAMED])}" + (" ..." if len(at) > MAX_NAMED else "")
            for described, at in kinds.items()
        )
    extra = layer_keys(template, count + 1)[-1]
    if strict and extra in by_key:
        total = count + 1
        while template.replace(LAYER, str(total)) in by_key:
            total += 1
        return (
            f"Stack({template!r}): `like` stacks {count} layers ({describe_like(target)}), but the checkpoint has "
            f"{total} ({keys[0] if keys else extra!r} to {template.replace(LAYER, str(total - 1))!r}); pass "
            "strict=False to restore the first layers only"
        )
    if not count:
        return "Stack of no layers: `like`'s leading axis has length 0"
    for dtype in dict.fromkeys(leaf.dtype for leaf in arrays):  # each stored dtype's cast checked
        first = next(leaf for leaf in arrays if leaf.dtype == dtype)
        if (problem := _virtual(first, path, (count, *first.shape)).mismatch(target, cast)) is not None:
            return f"{problem} (stacked from {_named(keys)})"
    leaf = _virtual(arrays[0], path, (count, *arrays[0].shape))
    if len({layer.dtype for layer in arrays}) > 1:  # read into `like`'s dtype, each layer cast on its way
        leaf = dataclasses.replace(leaf, dtype=np.dtype(target.dtype).name)
    return Stacked(leaf, tuple(arrays))


def plan_unstack(path: str, key: str, index: int, target: Any, by_key: dict[str, Leaf], cast: bool) -> Row | str:
    """How the new leaf at ``path`` is read as row ``index`` of the leaf at ``key``, or why it cannot be."""
    stacked = by_key.get(key)
    if stacked is None:
        return f"Unstack({key!r}, index={index}): the checkpoint has no {key!r}"
    if not isinstance(stacked, ArrayLeaf) or not stacked.shape:
        return f"Unstack({key!r}) needs a stacked array, found {stacked.describe()} at {key!r}"
    if not 0 <= index < stacked.shape[0]:
        return f"Unstack({key!r}, index={index}): index out of range for {key!r} ({stacked.describe()}, rows 0 to {stacked.shape[0] - 1})"
    leaf = _virtual(stacked, path, stacked.shape[1:])
    if (problem := leaf.mismatch(target, cast)) is not None:
        return f"{problem} (row {index} of {key!r}, {stacked.describe()})"
    return Row(leaf, stacked, index)


def unrestored_rows(rows: Sequence[tuple[str, Row]]) -> list[tuple[str, str]]:
    """For each stacked leaf some rows were planned from, the rows no new leaf takes, as
    ``(path, what)`` problems (a strict restore refuses them: `like` has fewer layers)."""
    taken: dict[str, tuple[ArrayLeaf, set[int], list[str]]] = {}
    for path, row in rows:
        entry = taken.setdefault(row.stacked.path, (row.stacked, set(), []))
        entry[1].add(row.index)
        entry[2].append(path)
    problems = []
    for stacked_path, (stacked, indices, paths) in taken.items():
        left = [i for i in range(stacked.shape[0]) if i not in indices]
        if left:
            problems.append(
                (
                    paths[0],
                    f"the checkpoint stacks {stacked.shape[0]} rows in {stacked_path!r} ({stacked.describe()}), but "
                    f"`like` takes {len(indices)} of them (not rows {_listed(left)}); pass strict=False to restore "
                    "these rows only",
                )
            )
    return problems


def _stored_as(leaf: Leaf, key: str, origin: Callable[[str], str] | None) -> str:
    """`` (stored as name)`` where the leaf's name in its format is not ``key``."""
    name = leaf.path if origin is None else origin(leaf.path)
    return "" if name == key else f" (stored as {name})"


def _named(keys: Sequence[str]) -> str:
    listed = ", ".join(repr(k) for k in keys[:MAX_NAMED])
    return listed + (f" and {len(keys) - MAX_NAMED} more" if len(keys) > MAX_NAMED else "")


def _listed(indices: Sequence[int]) -> str:
    return ", ".join(map(str, indices[:MAX_NAMED])) + (" ..." if len(indices) > MAX_NAMED else "")
