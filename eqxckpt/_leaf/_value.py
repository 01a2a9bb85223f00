"""`ScalarLeaf`, whose value is in the manifest, and `OpaqueLeaf`, whose value `load`
takes from `like`."""

import dataclasses
import enum
import sys
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from .._errors import ManifestError, UnsupportedLeafError
from .._scalars import bits_fit, nan_bits, scalar_from_json, scalar_to_json, with_bits
from .._tree import (
    SCALAR_TYPES,
    is_array_like,
)
from ._base import MAX_NAME_CHARS, SCALAR_NAMES, KeyRecord, Leaf, leaf_type_name

if TYPE_CHECKING:  # JAX is imported where a leaf is restored or saved, not to read a manifest
    pass

# One key entry: ("attr" | "dict" | "seq" | "index", key) plus "repr" for keys recorded by their repr.


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
        type_name = leaf_type_name(doc, path)
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

    @classmethod
    def of(cls, path: str, keys: tuple[KeyRecord, ...], type_name: str, name: str) -> "OpaqueLeaf":
        """The leaf of a function, class or data-less object of ``type_name`` called
        ``name``: both only shown, so each is cut to what a manifest keeps
        (`MAX_NAME_CHARS`, the last character an ellipsis), never refused."""
        return cls(path, keys, _shown(type_name), _shown(name))

    def describe(self) -> str:
        if not self.name:
            return f"<{self.type_name}>"
        return f"<{'class' if self.type_name.endswith(('type', 'Meta')) else 'function'} {self.name}>"

    def _fields(self) -> dict[str, Any]:
        return {"type": self.type_name, **({"name": self.name} if self.name else {})}

    @classmethod
    def from_json(cls, doc: dict[str, Any], path: str, keys: tuple[KeyRecord, ...]) -> "OpaqueLeaf":
        name = doc.get("name", "")
        if not isinstance(name, str) or len(name) > MAX_NAME_CHARS:
            raise ManifestError(f"Leaf {path!r}: 'name' must be a string of at most {MAX_NAME_CHARS} characters.")
        return cls(path, keys, leaf_type_name(doc, path), name)

    def mismatch(self, target: Any, cast: bool) -> str | None:
        return self._differs(target) if is_array_like(target) or isinstance(target, SCALAR_TYPES) else None

    def value(self, target: Any = None) -> Any:
        return target


def _shown(name: str) -> str:
    return name if len(name) <= MAX_NAME_CHARS else name[: MAX_NAME_CHARS - 1] + "\u2026"
