"""Stored dtypes and byte order (`_dtypes`)."""

import ml_dtypes
import numpy as np
import pytest

import eqxckpt
from eqxckpt._dtypes import STORED_DTYPES, check_dtype, little_endian


def test_little_endian_swaps_only_big_endian_arrays():
    little = np.arange(6, dtype="<i4")
    assert little_endian(little) is little
    fresh = little_endian(little, copy=True)
    assert fresh is not little and not np.shares_memory(fresh, little) and (fresh == little).all()
    big = np.arange(6, dtype=">f8")
    swapped = little_endian(big)
    assert swapped.dtype == np.dtype("<f8") and (swapped == big).all()
    assert little_endian(3.5).dtype == np.dtype("<f8")


def test_check_dtype_refuses_what_zarr3_cannot_store():
    for name in ("float32", "bfloat16", "int4", "bool"):
        assert name in STORED_DTYPES
    check_dtype(np.dtype("float32"), "w")
    with pytest.raises(eqxckpt.CheckpointError, match="'w' has dtype uint4.*Cast it to uint8"):
        check_dtype(np.dtype(ml_dtypes.uint4), "w")
