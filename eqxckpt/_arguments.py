"""`checked_arguments`: a public function's arguments checked against its annotations, so
that an argument of the wrong type is an `ArgumentError` naming it, never a bare
`TypeError` from deep inside (or a value silently taken for another: ``overwrite="no"``).

Only the annotations' outer types are checked (a ``dict`` is any mapping, whatever it
holds; a ``Callable`` is callable), with ``bool`` apart from ``int``; a numpy scalar, a
mapping or a list where a Python scalar, a dict or a tuple is asked for is passed on as
one. What a function accepts beyond its type (a positive count, a known mode) it checks
itself.
"""

import collections.abc
import functools
import inspect
import os
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from ._errors import ArgumentError

F = TypeVar("F", bound=Callable[..., Any])


def _fits(value: Any, hint: Any) -> bool:
    """Whether ``value``'s outer type is one ``hint`` allows (unknown hints allow anything)."""
    if hint is Any or hint is object:
        return True
    if hint is None or hint is type(None):
        return value is None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arm) for arm in typing.get_args(hint))
    if hint is bool:
        return isinstance(value, bool) or _numpy_kind(value) == "b"
    if hint is int:
        return (isinstance(value, int) and not isinstance(value, bool)) or _numpy_kind(value) in ("i", "u")
    if hint is float:
        return (isinstance(value, (int, float)) and not isinstance(value, bool)) or _numpy_kind(value) in (
            "i",
            "u",
            "f",
        )
    if hint is str:
        return isinstance(value, str)
    if origin is tuple or hint is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, (tuple, list)):
            return False
        if not args:
            return True
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_fits(v, args[0]) for v in value)
        return len(args) == len(value) and all(_fits(v, a) for v, a in zip(value, args))
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    target = origin if origin is not None else hint
    if target in (Callable, typing.Callable) or getattr(target, "__name__", "") == "Callable":
        return callable(value)
    if target is os.PathLike:
        return isinstance(value, os.PathLike)
    if target is dict:
        return isinstance(value, collections.abc.Mapping)
    if isinstance(target, type) and target.__module__ in ("builtins", "collections.abc") or _is_eqxckpt(target):
        return isinstance(value, target)
    return True  # a pytree, a type variable: anything


def _normalized(value: Any, hint: Any) -> Any:
    """``value`` as the function expects the type ``hint`` allows it as: a numpy scalar as
    the Python scalar, another mapping as a dict, a list as a tuple."""
    arms = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    origins = {typing.get_origin(arm) or arm for arm in arms}
    if _numpy_kind(value) and origins & {bool, int, float}:
        try:
            return value.item()
        except Exception:  # noqa: BLE001 - a traced value (inside jit) has none: refused as it is
            return value
    if dict in origins and not isinstance(value, dict) and isinstance(value, collections.abc.Mapping):
        return dict(value)
    if tuple in origins and isinstance(value, list):
        return tuple(value)
    return value


def _shown(value: Any) -> str:
    """``value`` as an error names it: its type and repr (just its type if repr fails)."""
    try:
        return f"{type(value).__name__} {value!r:.100}"
    except Exception:  # noqa: BLE001 - a user's object whose repr raises
        return type(value).__name__


def _numpy_kind(value: Any) -> str:
    """A numpy scalar's (or a 0-d numpy or JAX array's: a step counter kept on a device)
    kind (``b``, ``i``, ``u``, ``f``...), or "" for anything else: told without importing
    numpy."""
    module = type(value).__module__.partition(".")[0]
    if module not in ("numpy", "jax", "jaxlib") or getattr(value, "ndim", None) != 0:
        return ""
    return str(getattr(getattr(value, "dtype", None), "kind", ""))


def _is_eqxckpt(target: Any) -> bool:
    return isinstance(target, type) and target.__module__.startswith("eqxckpt.")


_NAMES = {bool: "True or False", int: "an int", float: "a number", str: "a str", dict: "a dict", list: "a list"}


def _describe(hint: Any) -> str:
    """What ``hint`` asks for, in words: ``an int or None``."""
    if hint is type(None) or hint is None:
        return "None"
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(_describe(arm) for arm in typing.get_args(hint)))
    if origin is typing.Literal:
        return " or ".join(repr(choice) for choice in typing.get_args(hint))
    target = origin if origin is not None else hint
    if target in _NAMES:
        return _NAMES[target]
    if getattr(target, "__name__", "") == "Callable":
        return "a callable"
    if target is os.PathLike:
        return "a path"
    if target is tuple:
        return "a tuple"
    return getattr(target, "__name__", str(hint))


def _hints(function: Callable[..., Any]) -> dict[str, Any]:
    """``function``'s annotations, evaluated; where one names what its module imports only
    for type checkers (to stay light: the command line's help imports no JAX), the
    parameters annotated as plain types only (the others are checked where they are used)."""
    try:
        return typing.get_type_hints(function)
    except NameError:
        return {
            name: parameter.annotation
            for name, parameter in inspect.signature(function).parameters.items()
            if not isinstance(parameter.annotation, str) and parameter.annotation is not inspect.Parameter.empty
        }


def checked_arguments(function: F) -> F:
    """Wrap the public ``function`` so that every argument is checked against its
    annotation first: one of the wrong type, or an unknown keyword, raises `ArgumentError`
    naming it and what it must be.

    ```python
    @checked_arguments
    def save(path: CheckpointPath, tree: PyTree, *, overwrite: bool = False) -> SaveHandle: ...
    ```
    """
    signature = inspect.signature(function)
    name = function.__qualname__.replace(".__init__", "")
    hints: dict[str, Any] | None = None

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal hints
        if hints is None:  # resolved at the first call: every module is loaded by then
            hints = _hints(function)
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as e:
            raise ArgumentError(f"{name}: {e}.") from None
        for parameter, value in bound.arguments.items():
            hint = hints.get(parameter)
            if hint is None or parameter == "self":
                continue
            if not _fits(value, hint):
                raise ArgumentError(f"{name}: {parameter} must be {_describe(hint)}, got {_shown(value)}.")
            bound.arguments[parameter] = _normalized(value, hint)
        return function(*bound.args, **bound.kwargs)

    return typing.cast(F, wrapper)
