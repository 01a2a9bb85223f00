"""`Stack` and `Unstack` into skeletons sharded over 4 CPU devices, from three formats.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python layout_probe.py DIR

Sharded along the stacked axis, along the others, over a 2-D mesh, and replicated;
every device's block is checked against the values stacked (or sliced) in memory.
eqxckpt's chunks are 256 bytes, so chunks straddle blocks; its chunk reads are counted:
each chunk the result needs is read once. Prints the number of restores checked.
"""

import collections
import os
import sys

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import eqxckpt
import eqxckpt._chunks as chunks_module
from eqxckpt._storage._disk import LocalChunkFiles

LAYERS = 4
STACK = {r"blocks/(.*)": eqxckpt.Stack(r"blocks/{i}/\1")}
UNSTACK = {r"blocks/(\d+)/(.*)": eqxckpt.Unstack(r"blocks/\2", index=r"\1")}
READS: collections.Counter = collections.Counter()


class CountedFiles(LocalChunkFiles):
    def _read_ranges(self, key, ranges, size):
        READS[key] += 1  # every read of a local chunk file, in one range or a slab at a time
        super()._read_ranges(key, ranges, size)


def write(kind: str, directory: str, flat: dict[str, np.ndarray]) -> str:
    where = f"{directory}/{kind}"
    if kind == "eqxckpt":
        tree: dict = {}
        for path, value in flat.items():
            node = tree
            *parents, last = path.split("/")
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = value
        eqxckpt.save(where, tree)
    elif kind == "safetensors":
        from safetensors.numpy import save_file

        save_file({path.replace("/", "."): value for path, value in flat.items()}, where)
    else:
        import orbax.checkpoint as ocp

        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(os.path.abspath(where), eqxckpt.load(write("eqxckpt", f"{directory}/for_orbax", flat)))
        checkpointer.wait_until_finished()
    return where


def check(out: jax.Array, expected: np.ndarray, sharding: NamedSharding, what: str) -> None:
    assert out.sharding.is_equivalent_to(sharding, out.ndim), (what, out.sharding)
    assert out.dtype == expected.dtype and out.shape == expected.shape, (what, out.dtype, out.shape)
    for shard in out.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index], what)


def main(directory: str) -> None:
    chunks_module.CHUNK_BYTES = 256
    import eqxckpt._storage._disk as local

    local.LocalChunkFiles = CountedFiles  # type: ignore[misc]
    for name in ("for_orbax", "per_layer", "stacked"):
        os.makedirs(f"{directory}/{name}", exist_ok=True)
    rng = np.random.default_rng(0)
    layers = [
        {"w": rng.standard_normal((8, 12)).astype(np.float32), "b": rng.integers(-9, 9, 4).astype(np.int32)}
        for _ in range(LAYERS)
    ]
    per_layer = {f"blocks/{i}/{name}": value for i, layer in enumerate(layers) for name, value in layer.items()}
    stacked = {f"blocks/{name}": np.stack([layer[name] for layer in layers]) for name in ("w", "b")}
    line = Mesh(np.array(jax.devices()), ("x",))
    grid = Mesh(np.array(jax.devices()).reshape(2, 2), ("x", "y"))
    stack_specs = [P("x"), P(None, "x"), P(None, None, "x"), P("x", "y"), P(None, "y", "x"), P()]
    row_specs = [P("x"), P(None, "x"), P("x", "y"), P()]
    checked = 0
    for kind in ("eqxckpt", "safetensors", "orbax"):
        per_layer_at = write(kind, f"{directory}/per_layer", per_layer)
        stacked_at = write(kind, f"{directory}/stacked", stacked)
        for spec in stack_specs:
            sharding = NamedSharding(grid if "y" in spec else line, spec)
            b_sharding = NamedSharding(sharding.mesh, P(*tuple(spec)[:2]))
            like = {
                "blocks": {
                    "w": jax.ShapeDtypeStruct(stacked["blocks/w"].shape, np.float32, sharding=sharding),
                    "b": jax.ShapeDtypeStruct(stacked["blocks/b"].shape, np.int32, sharding=b_sharding),
                }
            }
            READS.clear()
            out = eqxckpt.load(per_layer_at, like, transforms=STACK)
            for name in ("w", "b"):
                check(
                    out["blocks"][name],
                    stacked[f"blocks/{name}"],
                    like["blocks"][name].sharding,
                    f"{kind} stack {spec} {name}",
                )
            if kind == "eqxckpt":
                assert READS and max(READS.values()) == 1, (spec, READS)  # each chunk read once
            checked += 1
        for spec in row_specs:
            sharding = NamedSharding(grid if "y" in spec else line, spec)
            like = {
                "blocks": [
                    {
                        "w": jax.ShapeDtypeStruct((8, 12), np.float32, sharding=sharding),
                        "b": jax.ShapeDtypeStruct(
                            (4,), np.int32, sharding=NamedSharding(sharding.mesh, P(*tuple(spec)[:1]))
                        ),
                    }
                    for _ in range(LAYERS)
                ]
            }
            READS.clear()
            out = eqxckpt.load(stacked_at, like, transforms=UNSTACK)
            for i in range(LAYERS):
                for name in ("w", "b"):
                    what = f"{kind} unstack {spec} {i} {name}"
                    check(out["blocks"][i][name], layers[i][name], like["blocks"][i][name].sharding, what)
            if kind == "eqxckpt":
                assert READS and max(READS.values()) == 1, (spec, READS)
            checked += 1
    print(checked)


if __name__ == "__main__":
    main(sys.argv[1])
