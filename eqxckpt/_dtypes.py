"""Stored dtypes and byte order: which dtypes a checkpoint's arrays hold, and a host value
as the little-endian array whose bytes every writer stores."""

import sys
from typing import Any

import numpy as np

from ._errors import CheckpointError

# dtypes that zarr3 in TensorStore stores natively (uint4 is not among them).
STORED_DTYPES = frozenset(
    "bool int2 int4 int8 int16 int32 int64 uint8 uint16 uint32 uint64 "
    "float16 bfloat16 float32 float64 complex64 complex128 float8_e4m3fn "
    "float8_e4m3fnuz float8_e4m3b11fnuz float8_e5m2 float8_e5m2fnuz".split()
)


_NAMES: dict[Any, str] = {}


def dtype_name(dtype: Any) -> str:
    """``np.dtype(dtype).name``, known once per dtype (asked per leaf of a large tree)."""
    try:
        name = _NAMES.get(dtype)
    except TypeError:  # unhashable: asked directly
        return np.dtype(dtype).name
    if name is None:
        name = _NAMES[dtype] = np.dtype(dtype).name
    return name


def check_dtype(dtype: np.dtype, where: str) -> None:
    """Refuse a leaf at ``where`` whose ``dtype`` is not one of `STORED_DTYPES`."""
    if dtype.name not in STORED_DTYPES:
        hint = " Cast it to uint8 first." if dtype.name == "uint4" else ""
        raise CheckpointError(
            f"Leaf {where!r} has dtype {dtype.name}, which TensorStore's zarr3 cannot store natively.{hint}"
        )


def little_endian(value: Any, copy: bool = False) -> np.ndarray:
    """``value`` as a host array in the byte order every format eqxckpt writes holds
    (little-endian: the zarr3 ``bytes`` codec as eqxckpt configures it, the packed array,
    safetensors) and its digests cover. Every writer takes the values it stores from here,
    so their bytes, their digest and what a load returns agree: the array itself where its
    bytes are that already, else a byte-swapped copy (a big-endian numpy array).

    ``copy``: a fresh array in any case (one pass, swapping as it copies).
    """
    array = np.asarray(value)
    order = array.dtype.byteorder  # "=" native, "|" not applicable, "<" or ">" stated
    if copy or order == ">" or (order == "=" and _BIG_ENDIAN_HOST):
        return np.array(array, dtype=array.dtype.newbyteorder("<"), copy=True)
    return array


_BIG_ENDIAN_HOST = sys.byteorder == "big"
