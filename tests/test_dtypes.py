"""Stored dtypes and byte order (`_dtypes`)."""

import json

import jax
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
from hypothesis import given, settings, strategies as st

import eqxckpt
from eqxckpt._dtypes import STORED_DTYPES, check_dtype, little_endian, zarr_data_type


def test_little_endian_swaps_only_big_endian_arrays():
    little = np.arange(6, dtype="<i4")
    assert little_endian(little) is little
    fresh = little_endian(little, copy=True)
    assert fresh is not little and not np.shares_memory(fresh, little) and (fresh == little).all()
    big = np.arange(6, dtype=">f8")
    swapped = little_endian(big)
    assert swapped.dtype == np.dtype("<f8") and (swapped == big).all()
    assert little_endian(3.5).dtype == np.dtype("<f8")


def test_check_dtype_refuses_what_is_not_a_jax_array_dtype():
    for name in ("float32", "bfloat16", "int4", "bool", "uint4"):
        assert name in STORED_DTYPES
    check_dtype(np.dtype("float32"), "w")
    for dtype in (np.dtype(ml_dtypes.float6_e2m3fn), np.dtype("U3"), np.dtype("float128")):
        with pytest.raises(eqxckpt.CheckpointError, match=f"'w' has dtype {dtype.name}.*Cast it"):
            check_dtype(dtype, "w")


# Every dtype name JAX and ml_dtypes know; those JAX can make arrays of must all save.
CANDIDATE_NAMES = sorted(
    {"bool", *(f"{kind}{bits}" for kind in ("int", "uint") for bits in (2, 4, 8, 16, 32, 64))}
    | {"float16", "float32", "float64", "complex64", "complex128"}
    | {name for name in dir(ml_dtypes) if name.startswith(("float", "bfloat"))}
)


def _jax_makes(name: str) -> bool:
    try:
        np.asarray(jax.device_put(np.zeros(2, np.dtype(name))))
    except Exception:  # float6 kinds: ml_dtypes has them, XLA on this platform does not
        return False
    return True


JAX_DTYPES = [name for name in CANDIDATE_NAMES if _jax_makes(name)]


def test_every_dtype_jax_makes_arrays_of_is_stored():
    assert {"uint2", "uint4", "float4_e2m1fn", "float8_e8m0fnu", "float8_e4m3", "float8_e3m4"} <= set(JAX_DTYPES)
    assert set(JAX_DTYPES) <= STORED_DTYPES
    for name in JAX_DTYPES:
        check_dtype(np.dtype(name), "w")


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(sorted(STORED_DTYPES)),
    shape=st.sampled_from([(), (3,), (2, 5), (70_000,)]),
    as_jax=st.booleans(),
    data=st.data(),
)
def test_every_stored_dtype_round_trips_bit_exactly(tmp_path_factory, name, shape, as_jax, data):
    """Random bytes (NaNs and all) for every dtype, small (packed) and chunked leaves, numpy
    and JAX arrays: the same dtype and the same bytes back, and a zarr reader (TensorStore)
    reads the bytes under the ``data_type`` the format names."""
    dtype = np.dtype(name)
    count = int(np.prod(shape))
    raw = np.frombuffer(
        data.draw(st.binary(min_size=count * dtype.itemsize, max_size=count * dtype.itemsize)), np.uint8
    )
    if name in (
        "bool",
        "int2",
        "int4",
        "uint2",
        "uint4",
        "float4_e2m1fn",
    ):  # in range: the low bits, as ml_dtypes and JAX hold them
        bits = {"bool": 1, "int2": 2, "uint2": 2, "int4": 4, "uint4": 4, "float4_e2m1fn": 4}[name]
        raw = raw & ((1 << bits) - 1)  # ml_dtypes holds them in the low bits, unextended
    value = raw.reshape(-1).view(dtype).reshape(shape)
    if as_jax and name not in ("float64", "complex128", "int64", "uint64"):
        value = jax.device_put(value)
    path = tmp_path_factory.mktemp("dtypes") / "c"
    eqxckpt.save(path, {"w": value})
    back = eqxckpt.load(path, {"w": value})["w"]
    assert type(back) is type(value) and back.dtype == dtype and back.shape == shape
    assert np.asarray(back).reshape(-1).view(np.uint8).tobytes() == raw.tobytes()
    if count >= 70_000:  # its own array, not packed: what another zarr reader sees
        array = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path / "w")}}).result()
        assert array.dtype.name == zarr_data_type(name)
        assert np.asarray(array.read().result()).reshape(-1).view(np.uint8).tobytes() == raw.tobytes()


def test_a_zarr_json_whose_data_type_is_the_logical_one_is_refused(tmp_path):
    """uint4 is stored as uint8; a zarr.json saying uint4 (or anything else) is not what
    eqxckpt wrote."""
    eqxckpt.save(tmp_path / "c", {"w": np.arange(70_000, dtype=np.uint8).astype(ml_dtypes.uint4)})
    meta = tmp_path / "c" / "w" / "zarr.json"
    doc = json.loads(meta.read_text())
    assert doc["data_type"] == "uint8"
    meta.write_text(json.dumps({**doc, "data_type": "int8"}))
    with pytest.raises(eqxckpt.CorruptCheckpointError, match="zarr.json says int8"):
        eqxckpt.load(tmp_path / "c")


def test_a_dtype_stored_under_another_data_type_is_named_as_the_manifest_says_it(tmp_path):
    eqxckpt.save(tmp_path / "c", {"w": np.arange(70_000, dtype=np.uint8).astype(ml_dtypes.uint4)})
    meta = tmp_path / "c" / "w" / "zarr.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "data_type": "int4"}))
    with pytest.raises(eqxckpt.CorruptCheckpointError, match=r"manifest says uint4\[70000\] \(stored as uint8\)"):
        eqxckpt.load(tmp_path / "c")
