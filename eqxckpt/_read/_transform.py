"""Model surgery: `Transform` rules that map a new tree's leaves to an original's.

The rules are planned on paths alone (`plan`), so `load(..., transforms=...)`
decides which checkpoint leaves it needs before it reads any of them.

Keys are matched as the leaves' keys joined by ``/`` (``layers/0/weight``,
``dense_1/kernel``): exactly what `eqxckpt inspect` prints for ordinary names.
"""

import dataclasses
import enum
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from .._errors import TransformError
from .._paths import key_entry_record
from ._restack import Stack, Unstack, layer_keys


@dataclasses.dataclass(frozen=True)
class Transform:
    """How one leaf (or every leaf matching a regex) of the new tree is obtained.

    - `original_key`: the leaf's path in the original tree (``/`` for nesting);
      backreferences (``\\1``, ``\\g<name>``) refer to the rule's regex groups.
      Default: the same path as in the new tree.
    - `use_fallback`: take the value from the fallback tree instead (``new_tree``
      when ``default_to_original=True``, else the original).
    - `value_fn`: ``value -> value``, applied to the original value.
    - `multi_value_fn`: ``(key, original_tree) -> value``, for values built
      from several original leaves.

    ```python
    transforms = {r"layers/(\\d+)/w": eqxckpt.Transform(original_key=r"blocks/\\1/weight")}
    ```
    """

    original_key: str | None = None
    use_fallback: bool = False
    value_fn: Callable[[Any], Any] | None = None
    multi_value_fn: Callable[[str, Any], Any] | None = None


class RuleKind(enum.Enum):
    """Where a new leaf's value comes from."""

    ORIGINAL = "original"  # the original leaf at the rule's key (through value_fn, if any)
    NEW = "new"  # the new tree's own value (`like`'s)
    MULTI = "multi"  # computed from every original leaf (multi_value_fn)
    STACK = "stack"  # the stack of the original leaves at the rule's key, ``{i}`` each index (`Stack`)
    UNSTACK = "unstack"  # row ``index`` of the original leaf at the rule's key (`Unstack`)


@dataclasses.dataclass(frozen=True)
class Rule:
    """Where one new leaf's value comes from: an original leaf (at ``key``), the new tree, or all of them."""

    kind: RuleKind
    key: str = ""
    transform: Transform | None = None
    index: int = 0  # the row an UNSTACK rule takes

    @property
    def value_fn(self) -> Callable[[Any], Any] | None:
        return None if self.transform is None else self.transform.value_fn

    @property
    def multi_value_fn(self) -> Callable[[str, Any], Any] | None:
        return None if self.transform is None else self.transform.multi_value_fn


def readable_path(keypath_records: Any) -> str:
    """Keys joined by ``/`` as the user wrote them (unescaped), for matching rules."""
    return "/".join(str(record[1]) for record in keypath_records)


def keypath_string(keypath: tuple[Any, ...]) -> str:
    """A key path as `Transform` rules match it (keys joined by ``/``, unescaped)."""
    return readable_path([key_entry_record(entry) for entry in keypath])


AnyTransform = Transform | Stack | Unstack


def flatten_transformations(transformations: Any) -> list[tuple[str, re.Pattern, AnyTransform]]:
    """``{"a": {"b_(\\d)": T}}`` -> ``[("a/b_(\\d)", regex, T)]``, in insertion order."""
    if transformations is None:
        return []
    if not isinstance(transformations, dict):
        raise TransformError(
            f"transformations must be a (nested) dict of Transform, got {type(transformations).__name__}."
        )
    rules = []
    for key, value in transformations.items():
        if not isinstance(key, str):
            raise TransformError(f"Transformation key {key!r} must be a string (a path or regex).")
        if isinstance(value, dict):
            rules.extend((f"{key}/{sub}", None, t) for sub, _, t in flatten_transformations(value))
        elif isinstance(value, (Transform, Stack, Unstack)):
            rules.append((key, None, value))
        else:
            raise TransformError(
                f"Transformation {key!r} must be a Transform, Stack or Unstack, or a dict of them, got "
                f"{type(value).__name__}."
            )
    compiled = []
    for key, _, transform in rules:
        try:
            compiled.append((key, re.compile(key), transform))
        except re.error as e:
            raise TransformError(f"Transformation key {key!r} is not a valid regex: {e}.") from None
    return compiled


def plan_rules(
    new_paths: list[str], original_paths: set[str], transformations: Any, default_to_original: bool
) -> list[Rule]:
    """Decide, for each new path, where its value comes from (no values touched)."""
    rules = flatten_transformations(transformations)
    sources = []
    for path in new_paths:
        for key, regex, transform in rules:
            match = regex.fullmatch(path)
            if match is None:
                continue
            if isinstance(transform, (Stack, Unstack)):
                original = _expanded(key, transform.original_key, match, path)
                if isinstance(transform, Stack):
                    sources.append(Rule(RuleKind.STACK, original))
                else:
                    sources.append(Rule(RuleKind.UNSTACK, original, index=transform.row(match, path)))
            elif transform.multi_value_fn is not None:
                sources.append(Rule(RuleKind.MULTI, path, transform))
            elif transform.use_fallback:
                sources.append(Rule(RuleKind.NEW) if default_to_original else Rule(RuleKind.ORIGINAL, path, transform))
            else:
                original = path
                if transform.original_key is not None:
                    original = _expanded(key, transform.original_key, match, path)
                sources.append(Rule(RuleKind.ORIGINAL, original, transform))
            break
        else:
            in_both = path in original_paths
            sources.append(Rule(RuleKind.ORIGINAL, path) if in_both and default_to_original else Rule(RuleKind.NEW))
    return sources


def _expanded(key: str, original_key: str, match: re.Match, path: str) -> str:
    """A rule's ``original_key`` with the backreferences to its regex's groups filled in."""
    try:
        return match.expand(original_key)
    except (re.error, IndexError) as e:
        raise TransformError(
            f"Transformation {key!r} -> original_key {original_key!r} cannot be applied to {path!r}: {e}. Check "
            "the backreferences against the regex's groups."
        ) from None


def missing_originals(new_paths: list[str], sources: list[Rule], original_paths: set[str]) -> list[tuple[str, str]]:
    """(new path, original key) for rules that point at nothing."""
    missing = []
    for path, source in zip(new_paths, sources):
        if source.kind in (RuleKind.ORIGINAL, RuleKind.UNSTACK) and source.key not in original_paths:
            missing.append((path, source.key))
    return missing


def apply_transformations(
    original_tree: PyTree,
    transforms: dict[str, Any],
    new_tree: PyTree = None,
    default_to_original: bool = True,
) -> PyTree:
    """Build ``new_tree``'s structure from ``original_tree``'s values by the rules.

    A key in ``new_tree`` but not the original comes from ``new_tree``; a key
    only in the original is dropped; a key in both that no rule mentions comes
    from the original if ``default_to_original`` else from ``new_tree``.

    **Arguments:**

    - `original_tree`: the pytree the values come from.
    - `transforms`: ``{regex: Transform}`` (nested dicts join keys with ``/``), as
      `eqxckpt.load`'s ``transforms``; `Stack` and `Unstack` rules stack the
      original leaves (numpy's or JAX's ``stack``) or take a row of one.
    - `new_tree`: the pytree whose structure the result has.
    - `default_to_original`: whether unmentioned keys in both trees take the original's value.

    **Returns:** a pytree of ``new_tree``'s structure.

    ```python
    original = {"a": 1, "dense_1": {"kernel": 2}}
    rules = {r"([a-z]+)_([0-9])_([a-z]+)": eqxckpt.Transform(original_key=r"\\1_\\2/\\3")}
    eqxckpt.apply_transformations(original, rules, {"a": ..., "dense_1_kernel": ...})  # {'a': 1, 'dense_1_kernel': 2}
    ```
    """
    original = {keypath_string(kp): leaf for kp, leaf in jtu.tree_flatten_with_path(original_tree)[0]}
    with_path, treedef = jtu.tree_flatten_with_path(new_tree)
    new_paths = [keypath_string(kp) for kp, _ in with_path]
    sources = plan_rules(new_paths, set(original), transforms, default_to_original)
    missing = missing_originals(new_paths, sources, set(original))
    if missing:
        raise TransformError(
            "Transformations point at keys the original tree does not have: "
            + ", ".join(f"{p!r} <- {k!r}" for p, k in missing)
        )
    values = []
    for (keypath, new_value), rule in zip(with_path, sources):
        if rule.kind is RuleKind.NEW:
            values.append(new_value)
        elif rule.kind is RuleKind.STACK:
            values.append(_stacked(keypath_string(keypath), rule.key, new_value, original))
        elif rule.kind is RuleKind.UNSTACK:
            stacked = original[rule.key]
            if not 0 <= rule.index < (np.shape(stacked) or (0,))[0]:
                raise TransformError(
                    f"Unstack({rule.key!r}, index={rule.index}) for {keypath_string(keypath)!r}: index out of range "
                    f"for {rule.key!r} of shape {tuple(np.shape(stacked))}."
                )
            values.append(stacked[rule.index])
        elif rule.multi_value_fn is not None:
            values.append(rule.multi_value_fn(rule.key, original_tree))
        else:
            value = original[rule.key]
            values.append(rule.value_fn(value) if rule.value_fn is not None else value)
    return jtu.tree_unflatten(treedef, values)


def _stacked(path: str, template: str, new_value: Any, original: dict[str, Any]) -> Any:
    """The stack of ``original``'s layers at ``template``, as many as ``new_value``'s leading
    axis: numpy's or JAX's ``stack`` of arrays, a `jax.ShapeDtypeStruct` of skeletons."""
    rule = f"Stack({template!r}) for {path!r}"
    if not np.shape(new_value) or not np.shape(new_value)[0]:
        raise TransformError(
            f"{rule} needs a leaf with a leading layer axis of at least one layer in the new tree, found "
            f"{type(new_value).__name__} of shape {tuple(np.shape(new_value))}."
        )
    keys = layer_keys(template, np.shape(new_value)[0])
    absent = [key for key in keys if key not in original]
    if absent:
        raise TransformError(f"{rule}: the original tree has no {absent[:8]}.")
    layers = [original[key] for key in keys]
    odd = [
        key
        for key, x in zip(keys, layers)
        if not hasattr(x, "shape") and not isinstance(x, (bool, int, float, complex))
    ]
    if odd:
        raise TransformError(f"{rule}: layers {odd[:8]} are not arrays or numbers.")
    layers = [x if hasattr(x, "shape") else np.asarray(x) for x in layers]
    kinds = {(tuple(x.shape), str(x.dtype)) for x in layers}
    if len(kinds) > 1:
        found = {key: f"{x.dtype}{list(x.shape)}" for key, x in zip(keys, layers)}
        raise TransformError(f"{rule}: the layers differ in shape or dtype: {found}.")
    if all(isinstance(x, jax.ShapeDtypeStruct) for x in layers):
        return jax.ShapeDtypeStruct((len(layers), *layers[0].shape), layers[0].dtype)
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in layers):
        raise TransformError(f"{rule}: some layers are arrays, some shapes only (jax.ShapeDtypeStruct).")
    if any(isinstance(x, jax.Array) for x in layers):
        return jnp.stack(layers)
    return np.stack([np.asarray(x) for x in layers])
