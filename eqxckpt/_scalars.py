"""Python scalars in a manifest's JSON, bit for bit: non-finite floats as strings, and
the bits of a NaN that JSON cannot tell apart from ``float("nan")``."""

import math
import struct
from typing import Any

from ._errors import ManifestError


def float_to_json(x: float) -> float | str:
    """A float as JSON can hold it: non-finite values as ``'nan'``, ``'inf'``, ``'-inf'``."""
    return x if math.isfinite(x) else repr(x)


def scalar_to_json(value: Any) -> tuple[str, Any]:
    """(type name, JSON value) of a Python scalar leaf; floats survive bit for bit, but for
    the sign and payload of a NaN (see `nan_bits`)."""
    if value is None:
        return "none", None
    if isinstance(value, bool):
        return "bool", value
    if isinstance(value, int):
        return "int", value
    if isinstance(value, float):
        return "float", float_to_json(value)
    if isinstance(value, complex):
        return "complex", [float_to_json(value.real), float_to_json(value.imag)]
    if isinstance(value, str):
        return "str", value
    raise TypeError(type(value))


# The bits of float("nan"), the NaN a JSON "nan" reads back as.
_NAN_BITS = struct.unpack("<Q", struct.pack("<d", math.nan))[0]


def _float_bits(x: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", x))[0]


def nan_bits(value: Any) -> Any:
    """What JSON loses of a float or complex scalar: the IEEE-754 bits (16 lowercase hex
    digits) of a NaN that is not float("nan") (another sign or payload: ``inf - inf`` is
    ``-nan`` on x86), for a complex ``[real's or None, imag's or None]``; None when
    `scalar_to_json` keeps every bit."""
    parts = [value.real, value.imag] if isinstance(value, complex) else [value] if isinstance(value, float) else []
    bits = [f"{_float_bits(x):016x}" if math.isnan(x) and _float_bits(x) != _NAN_BITS else None for x in parts]
    if not any(bits):
        return None
    return bits if isinstance(value, complex) else bits[0]


def with_bits(value: Any, bits: Any) -> Any:
    """``value`` (as `scalar_from_json` gives it) with the NaNs that `nan_bits` recorded;
    `ManifestError` for ``bits`` of another form."""

    def part(x: float, hex_bits: Any) -> float:
        if hex_bits is None:
            return x
        if not math.isnan(x):
            raise ManifestError(f"Bits {hex_bits!r} recorded for {x!r}, which is not a NaN.")
        if not (isinstance(hex_bits, str) and len(hex_bits) == 16 and all(c in "0123456789abcdef" for c in hex_bits)):
            raise ManifestError(f"Expected 16 lowercase hex digits of a NaN's bits, found {hex_bits!r}.")
        return struct.unpack("<d", struct.pack("<Q", int(hex_bits, 16)))[0]

    if isinstance(value, complex) and isinstance(bits, list) and len(bits) == 2:
        return complex(part(value.real, bits[0]), part(value.imag, bits[1]))
    if isinstance(value, float) and not isinstance(bits, list):
        return part(value, bits)
    raise ManifestError(f"Expected the bits of a {type(value).__name__}'s NaNs, found {bits!r}.")


def bits_fit(value: Any, bits: Any) -> bool:
    """Whether ``bits`` are what `nan_bits` records for a value read back as ``value``."""
    try:
        return nan_bits(with_bits(value, bits)) == bits
    except ManifestError:
        return False


def float_from_json(x: Any) -> float:
    """The inverse of `float_to_json`; `ManifestError` for anything else."""
    if isinstance(x, str) and x in ("nan", "inf", "-inf"):
        return float(x)
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        try:
            return float(x)
        except OverflowError:  # an int no float holds: never written
            pass
    raise ManifestError(f"Expected a float in the manifest, found {str(x)[:80]!r}.")


def scalar_from_json(type_name: str, value: Any) -> Any:
    """The inverse of `scalar_to_json`; `ManifestError` for a value that does not fit its type."""
    if type_name == "none" and value is None:
        return None
    if type_name == "bool" and isinstance(value, bool):
        return value
    if type_name == "int" and isinstance(value, int) and not isinstance(value, bool):
        return value
    if type_name == "float":
        return float_from_json(value)
    if type_name == "complex" and isinstance(value, list) and len(value) == 2:
        return complex(float_from_json(value[0]), float_from_json(value[1]))
    if type_name == "str" and isinstance(value, str):
        return value
    raise ManifestError(f"Scalar of type {type_name!r} has an invalid value {value!r}.")
