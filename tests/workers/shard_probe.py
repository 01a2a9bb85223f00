"""Restore leaves saved in small chunks onto 8 CPU devices, split every way; check every value.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python shard_probe.py DIR

Chunks of 256 bytes, so blocks and chunks straddle each other, edge chunks are
partial, and one chunk feeds several devices' blocks (read straight into them, or
through a buffer for a 2-D split). Prints the number of restores checked.
"""

import sys
import warnings

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import eqxckpt
import eqxckpt._chunks as chunks_module


def main(directory: str) -> None:
    chunks_module.CHUNK_BYTES = 256
    warnings.simplefilter("ignore")  # each restore takes one leaf (strict=False)
    rng = np.random.default_rng(0)
    tree = {
        "m": rng.standard_normal((40, 24)).astype(np.float32),
        "t": rng.integers(0, 1000, (8, 6, 12)).astype(np.int16),
        "wide": rng.standard_normal((3, 64)).astype(np.float32),
        "k": jax.random.split(jax.random.key(1), 16),
        "count": np.array(7, np.int32),  # 0-d, as an optimizer's step count: put on every device
    }
    eqxckpt.save(f"{directory}/c", tree)
    line = Mesh(np.array(jax.devices()), ("x",))
    grid = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    cases = {
        "m": [P("x", None), P(None, "x"), P(), P("x", "y"), P("y", "x"), P(None, "y")],
        "t": [P("x"), P(None, None, "y"), P(None, "y", "x"), P()],
        "wide": [P(None, "x"), P(None, "y")],
        "k": [P("x"), P()],
        "count": [P()],
    }
    checked = 0
    for name, specs in cases.items():
        for spec in specs:
            mesh = grid if "y" in spec else line
            sharding = NamedSharding(mesh, spec)
            value = tree[name]
            like = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)
            out = eqxckpt.load(f"{directory}/c", {name: like}, strict=False)[name]
            assert out.sharding.is_equivalent_to(sharding, out.ndim), (name, spec, out.sharding)
            if name == "k":
                out, value = jax.random.key_data(out), jax.random.key_data(value)
            for shard in out.addressable_shards:  # every device's block
                np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(value)[shard.index], f"{name} {spec}")
            checked += 1
    # 3 rows over 8 devices: the caller's sharding does not fit, which is JAX's error to
    # raise (it was reported as a corrupt checkpoint, to be restored from a copy).
    uneven = jax.ShapeDtypeStruct((3, 64), np.float32, sharding=NamedSharding(line, P("x", None)))
    try:
        eqxckpt.load(f"{directory}/c", {"wide": uneven}, strict=False)
    except eqxckpt.CheckpointError as e:
        raise AssertionError(f"an uneven sharding called the checkpoint damaged: {e}") from None
    except ValueError as e:
        assert "evenly divide" in str(e), e
    else:
        raise AssertionError("an uneven sharding was accepted")
    print(checked)


if __name__ == "__main__":
    main(sys.argv[1])
