"""Stored dtypes and byte order: which dtypes a checkpoint's arrays hold, and a host value
as the little-endian array whose bytes every writer stores."""

import sys
from typing import Any

import numpy as np

from ._errors import CheckpointError

# Every dtype JAX has, by the zarr v3 ``data_type`` its arrays are stored under: its own
# name where zarr v3 (as TensorStore reads it) has one; else ``uint8``, one byte per
# element exactly as JAX and ml_dtypes hold them, the manifest recording the logical dtype.
ZARR_DATA_TYPES: dict[str, str] = {
    **{
        name: name
        for name in (
            "bool int2 int4 int8 int16 int32 int64 uint8 uint16 uint32 uint64 "
            "float16 bfloat16 float32 float64 complex64 complex128 float8_e3m4 float8_e4m3fn "
            "float8_e4m3fnuz float8_e4m3b11fnuz float8_e5m2 float8_e5m2fnuz float8_e8m0fnu float4_e2m1fn"
        ).split()
    },
    "uint2": "uint8",
    "uint4": "uint8",
    "float8_e4m3": "uint8",
}
STORED_DTYPES = frozenset(ZARR_DATA_TYPES)


def zarr_data_type(name: str) -> str:
    """The zarr v3 ``data_type`` an array of the stored dtype ``name`` is written under."""
    return ZARR_DATA_TYPES[name]


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
        raise CheckpointError(
            f"Leaf {where!r} has dtype {dtype.name}, which is not a JAX array dtype eqxckpt stores (one of "
            f"{', '.join(sorted(STORED_DTYPES))}). Cast it to one of those first."
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
