"""Tree equality for tests: same structure, same leaf types, array leaves equal bit for
bit; and crafted manifests (a test's change, with a checksum that matches)."""

import json

import jax
import numpy as np

from eqxckpt._tree import is_prng_key_dtype


def crafted_manifest(doc: dict) -> bytes:
    """The manifest ``doc`` (changed by a test), with a checksum that matches: as someone
    crafting it would write it, so that a reader's checks after the checksum are tested.
    A version-5 manifest whose ``leaves`` a test lists as records (`manifest_doc`) gets
    them back as the leaf table the writer would make of them."""
    from eqxckpt._manifest import with_checksum  # here: the new tests also run on code from before it

    doc = {k: v for k, v in doc.items() if k != "crc32c"}
    if doc.get("version") == 5 and isinstance(doc.get("leaves"), list):
        from eqxckpt._manifest import leaf_cell, table_of

        doc["leaves"] = table_of(map(leaf_cell, doc["leaves"]))
    return with_checksum(json.dumps(doc).encode())


def manifest_doc(raw) -> dict:
    """A manifest (its bytes or text) as a dict whose ``leaves`` are records, one per leaf,
    whatever the version: what tests read and change (`crafted_manifest` writes it back)."""
    doc = json.loads(raw)
    if isinstance(doc.get("leaves"), dict):
        from eqxckpt._manifest import table_rows

        doc["leaves"] = table_rows(doc["leaves"])
    return doc


def _bits(x):
    if isinstance(x, jax.Array) and is_prng_key_dtype(x.dtype):
        return ("key", str(jax.random.key_impl(x)), np.asarray(jax.random.key_data(x)))
    arr = np.asarray(x)
    return (arr.dtype, arr.shape, arr.tobytes())


def assert_trees_equal(a, b):
    """Same structure, same leaf types, and array leaves equal bit for bit."""
    leaves_a, def_a = jax.tree_util.tree_flatten(a)
    leaves_b, def_b = jax.tree_util.tree_flatten(b)
    assert def_a == def_b, f"{def_a} != {def_b}"
    for x, y in zip(leaves_a, leaves_b):
        if isinstance(x, (jax.Array, np.ndarray, np.generic)):
            assert type(x) is type(y) or (isinstance(x, jax.Array) and isinstance(y, jax.Array)), (type(x), type(y))
            bx, by = _bits(x), _bits(y)
            assert bx[0] == by[0] and bx[1] == by[1], (bx[:2], by[:2])
            if bx[0] == "key":
                np.testing.assert_array_equal(bx[2], by[2])
            else:
                assert bx[2] == by[2], "array bytes differ"
        elif isinstance(x, float) and x != x:
            assert y != y
        else:
            assert type(x) is type(y) and (x == y or x is y), (x, y)
