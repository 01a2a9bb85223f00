"""The restore engine (`eqxckpt._read._restore`, `_place`) onto several CPU devices of one
JAX process, each test a worker process started with that many devices (`on_devices`):
every split of a mesh, blocks placed in bands, layouts restacked onto sharded targets, and
host memory kinds. Restores across several processes are in `test_distributed.py`."""

import pytest
from conftest import WORKERS, on_devices

pytestmark = pytest.mark.multiprocess  # every test here starts a worker process


def test_sharded_restores_hold_the_saved_values_for_every_split(tmp_path):
    """Onto 8 CPU devices (a worker process): by rows, columns, 2-D meshes, replicated,
    PRNG keys, a 0-d leaf; chunks of 256 bytes that straddle blocks, partial edge chunks. Every
    device's block is the saved values (each chunk read once, copied into each block)."""
    assert on_devices(8, [str(WORKERS / "shard_probe.py"), str(tmp_path)]).strip().splitlines()[-1] == "15"


SHARDED = r"""
import sys
import jax, jax.numpy as jnp, numpy as np, ml_dtypes
import eqxckpt
from eqxckpt._read import _place
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
_place.STAGE_CPU = sys.argv[2] == "1"
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
w = (np.arange(64 * 48, dtype=np.float32).reshape(64, 48) - 1000) / 8
keys = jax.random.split(jax.random.key(1), 4096)
eqxckpt.save(sys.argv[1] + "/" + sys.argv[2], {"w": w, "keys": keys})
for spec in [P("a"), P(None, "b"), P(), P("a", "b"), P("b", "a"), P(("a", "b"))]:
    for dtype in [jnp.float32, jnp.bfloat16]:
        sharding = NamedSharding(mesh, spec)
        key_sharding = NamedSharding(mesh, P(spec[0]) if len(spec) else P())
        like = {"w": jax.ShapeDtypeStruct(w.shape, dtype, sharding=sharding),
                "keys": jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=key_sharding)}
        out = eqxckpt.load(sys.argv[1] + "/" + sys.argv[2], like, cast=True, host_memory_budget=2048)
        assert out["w"].sharding == sharding and out["w"].dtype == dtype
        for shard in out["w"].addressable_shards:
            want = w.astype(dtype)[shard.index]
            assert np.array_equal(np.asarray(shard.data).view(np.uint8), want.view(np.uint8)), (spec, dtype)
        assert np.array_equal(jax.random.key_data(out["keys"]), jax.random.key_data(keys)), spec
# Chunks swapped between two leaves pass their checksums: every split, columns too, checks
# the digest as its blocks are placed (blocks split by columns were placed unchecked).
import pathlib
swapped = sys.argv[1] + "/swapped" + sys.argv[2]
eqxckpt.save(swapped, {"p": np.zeros((64, 48), np.float32), "q": np.ones((64, 48), np.float32)})
p, q = pathlib.Path(swapped, "p/c/0/0"), pathlib.Path(swapped, "q/c/0/0")
p_bytes, q_bytes = p.read_bytes(), q.read_bytes()
p.write_bytes(q_bytes)
q.write_bytes(p_bytes)
for spec in [P("a"), P(None, "b"), P(), P("a", "b"), P("b", "a"), P(("a", "b"))]:
    like = {k: jax.ShapeDtypeStruct((64, 48), jnp.float32, sharding=NamedSharding(mesh, spec)) for k in "pq"}
    try:
        eqxckpt.load(swapped, like, host_memory_budget=2048)
    except eqxckpt.CorruptCheckpointError as e:
        assert "not the bytes saved" in str(e), e
    else:
        raise SystemExit(f"chunks swapped between leaves were loaded into {spec}")
print("ok")
"""


@pytest.mark.parametrize("staged_flag", ["0", "1"], ids=["host", "staged"])
def test_sharded_blocks_larger_than_the_budget_are_bit_exact(tmp_path, staged_flag):
    """4 CPU devices on a 2x2 mesh, by rows, columns, both, replicated; a 2 KiB budget,
    so every block is placed in several bands; as stored and cast; PRNG keys; chunks
    swapped between leaves caught by their digests on every split."""
    assert on_devices(4, ["-c", SHARDED, str(tmp_path), staged_flag]).strip().endswith("ok")


def test_sharded_skeletons_along_every_axis_from_three_formats(tmp_path):
    """Onto 4 CPU devices (a worker process): stacked along the layer axis and the others,
    a 2-D mesh and replicated; rows by rows, columns, 2-D. Every device's block is the
    stored values; eqxckpt's chunks (256 bytes, straddling blocks) are each read once."""
    assert on_devices(4, [str(WORKERS / "layout_probe.py"), str(tmp_path)]).strip().splitlines()[-1] == "30"


PINNED = """
import sys
import jax, numpy as np, eqxckpt
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

where = sys.argv[1]
mesh = Mesh(np.array(jax.devices()), ("x",))
pinned = lambda spec: NamedSharding(mesh, spec, memory_kind="pinned_host")
x = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
eqxckpt.save(f"{where}/layers", {"blocks": [x, x + 1]})
eqxckpt.save(f"{where}/stacked", {"blocks": np.stack([x, x + 1])})
layer = [jax.ShapeDtypeStruct((8, 4), np.float32, sharding=pinned(P("x")))] * 2
got = {  # (restored, expected)
    "plain": (eqxckpt.load(f"{where}/layers", {"blocks": layer})["blocks"][1], x + 1),
    "stack": (
        eqxckpt.load(
            f"{where}/layers",
            {"blocks": jax.ShapeDtypeStruct((2, 8, 4), np.float32, sharding=pinned(P(None, "x")))},
            transforms={"blocks": eqxckpt.Stack("blocks/{i}")},
        )["blocks"],
        np.stack([x, x + 1]),
    ),
    "unstack": (
        eqxckpt.load(
            f"{where}/stacked", {"blocks": layer}, transforms={r"blocks/(\\d+)": eqxckpt.Unstack("blocks", index=r"\\1")}
        )["blocks"][1],
        x + 1,
    ),
}
for name, (value, want) in got.items():
    kinds = {s.data.sharding.memory_kind for s in value.addressable_shards}
    assert value.sharding.memory_kind == "pinned_host" and kinds == {"pinned_host"}, (name, kinds)
    # Host memory is read shard by shard (indexing it would compute there).
    assert all(np.asarray(s.data).tobytes() == want[s.index].tobytes() for s in value.addressable_shards), name
    print(name, "pinned")
"""


def test_every_restore_path_lands_in_pinned_host_memory(tmp_path):
    """#52: a plain restore, a `Stack` and an `Unstack` onto ``memory_kind="pinned_host"``
    shardings over 2 CPU devices (optimizer state offloaded to host memory) each land there,
    bit-exact; the layout restores raised a bare ``ValueError`` (a memory kind mismatch)."""
    out = on_devices(2, ["-c", PINNED, str(tmp_path)])
    assert out.split() == ["plain", "pinned", "stack", "pinned", "unstack", "pinned"], out
