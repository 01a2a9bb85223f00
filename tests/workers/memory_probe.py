"""Peak memory of one eqxckpt operation, measured in a fresh process (Linux).

    python memory_probe.py save|save_async|load|load_params|copy|to_safetensors|from_safetensors PATH
    python memory_probe.py save_large|load_sharded PATH [BUDGET_MIB]
    python memory_probe.py save_leaf PATH
    python memory_probe.py load_leaf PATH BUDGET_MIB rows|columns|replicated
    python memory_probe.py save_stacked|load_stacked|load_unstacked PATH
    python memory_probe.py save_big PATH
    python memory_probe.py load_big PATH BUDGET_MIB one|rows DTYPE STAGED

``load_sharded`` restores the 1 GiB ``save_large`` state onto every local device
(``XLA_FLAGS=--xla_force_host_platform_device_count=8`` makes 8 CPU devices),
rows split across them, within ``host_memory_budget`` (BUDGET_MIB; default None).
``load_leaf`` restores the one 256 MiB leaf of ``save_leaf`` onto every local
device, split by rows (``P("x", None)``), by columns (``P(None, "x")``) or
replicated (``P()``), within BUDGET_MIB.
``load_stacked`` restores the params of ``save``'s state (8 layers) into a scanned
skeleton with `Stack`; ``save_stacked`` saves them stacked, and ``load_unstacked``
restores those into the per-layer skeleton with `Unstack`.

``load_big`` restores the one 1 GiB float32 leaf of ``save_big`` onto the first
device (one) or every local device split by rows, as DTYPE (float32, or a cast),
within BUDGET_MIB; STAGED=1 builds the result on the devices band by band as on a
GPU (`_place.STAGE_CPU`).

Prints JSON: the peak RSS above the level just before the operation, and the
bytes saved or restored.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import eqxckpt

# The package imports these on first use: import them now, so the peak measured is the operation's.
eqxckpt.load, eqxckpt.open, eqxckpt.save, eqxckpt.save_safetensors, eqxckpt.Stack  # noqa: B018


def state():
    """~192 MiB: params of 64 MiB and two moments of the same size, 24 leaves."""
    rng = np.random.default_rng(0)

    def layer():
        return {
            "w": jnp.asarray(rng.standard_normal((1024, 2048), np.float32)),
            "b": jnp.asarray(rng.standard_normal(2048, np.float32)),
        }

    params = {"layers": [layer() for _ in range(8)]}

    def moment():
        return jax.tree_util.tree_map(lambda x: jnp.asarray(rng.standard_normal(x.shape, np.float32)), params)

    return {"model": params, "opt": {"mu": moment(), "nu": moment()}}


def kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


LARGE = {"leaves": 8, "shape": (8192, 4096)}  # 8 x 128 MiB of float32: 1 GiB


def large(path, op, budget_mib=None):
    leaves, shape = LARGE["leaves"], LARGE["shape"]
    if op == "save_large":
        eqxckpt.save(path, {f"w{i}": np.full(shape, i, np.float32) for i in range(leaves)})
        print(json.dumps({"peak": 0, "bytes": leaves * 4 * shape[0] * shape[1]}))
        return
    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    like = {f"w{i}": jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding) for i in range(leaves)}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = kib("VmRSS")
    budget = None if budget_mib is None else int(budget_mib) << 20
    out = jax.block_until_ready(eqxckpt.load(path, like, host_memory_budget=budget))
    peak = (kib("VmHWM") - before) * 1024
    for i in range(leaves):  # every value, on every device
        assert len(out[f"w{i}"].addressable_shards) == len(devices)
        assert all((np.asarray(shard.data) == i).all() for shard in out[f"w{i}"].addressable_shards)
    print(json.dumps({"peak": peak, "bytes": leaves * 4 * shape[0] * shape[1], "devices": len(devices)}))


LEAF = (8192, 8192)  # float32: 256 MiB
SPECS = {"rows": ("x", None), "columns": (None, "x"), "replicated": ()}


def one_leaf(path, op, budget_mib="16", spec="rows"):
    expected = np.arange(LEAF[0], dtype=np.float32)[:, None] + np.arange(LEAF[1], dtype=np.float32)[None, :] * 1e4
    if op == "save_leaf":
        eqxckpt.save(path, {"w": expected})
        print(json.dumps({"peak": 0, "bytes": expected.nbytes}))
        return
    nbytes = expected.nbytes
    del expected
    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*SPECS[spec]))
    like = {"w": jax.ShapeDtypeStruct(LEAF, jnp.float32, sharding=sharding)}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = kib("VmRSS")
    out = jax.block_until_ready(eqxckpt.load(path, like, host_memory_budget=int(budget_mib) << 20))
    peak = (kib("VmHWM") - before) * 1024
    assert out["w"].sharding == sharding and len(out["w"].addressable_shards) == len(devices)
    rows, cols = np.arange(LEAF[0], dtype=np.float32), np.arange(LEAF[1], dtype=np.float32) * 1e4
    for shard in out["w"].addressable_shards:  # every value, on every device
        r, c = shard.index
        assert (np.asarray(shard.data) == rows[r][:, None] + cols[c][None, :]).all()
    print(json.dumps({"peak": peak, "bytes": nbytes, "devices": len(devices)}))


BIG = (65536, 4096)  # float32: 1 GiB


def big_rows(start, stop):
    """Rows of the ``save_big`` leaf: exact in float32, different in every row (mod 4096) and column."""
    return ((np.arange(start, stop, dtype=np.int32)[:, None] % 4096) * 4096 + np.arange(BIG[1], dtype=np.int32)).astype(
        np.float32
    )


def big(path, op, budget_mib="256", spec="one", dtype="float32", staged="0"):
    if op == "save_big":
        data = np.empty(BIG, np.float32)
        for start in range(0, BIG[0], 8192):
            data[start : start + 8192] = big_rows(start, start + 8192)
        eqxckpt.save(path, {"w": data})
        print(json.dumps({"peak": 0, "bytes": data.nbytes}))
        return
    from eqxckpt._read import _place

    _place.STAGE_CPU = staged == "1"
    devices = jax.devices()
    if spec == "one":
        sharding = jax.sharding.SingleDeviceSharding(devices[0])
    else:
        sharding = jax.sharding.NamedSharding(
            jax.sharding.Mesh(np.array(devices), ("x",)), jax.sharding.PartitionSpec("x")
        )
    like = {"w": jax.ShapeDtypeStruct(BIG, jnp.dtype(dtype), sharding=sharding)}
    jax.jit(lambda x: x + 1)(jnp.zeros(8)).block_until_ready()  # XLA's compiler set up: part of the baseline
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = kib("VmRSS")
    out = jax.block_until_ready(eqxckpt.load(path, like, cast=True, host_memory_budget=int(budget_mib) << 20))
    peak = (kib("VmHWM") - before) * 1024
    assert out["w"].sharding == sharding and out["w"].dtype == jnp.dtype(dtype)
    for shard in out["w"].addressable_shards:  # every value, bit for bit, a band at a time
        rows = shard.index[0].indices(BIG[0])
        for start in range(rows[0], rows[1], 8192):
            got = np.asarray(shard.data[start - rows[0] : start - rows[0] + 8192])
            want = big_rows(start, min(rows[1], start + 8192)).astype(jnp.dtype(dtype))
            assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), start
    print(json.dumps({"peak": peak, "bytes": out["w"].nbytes, "devices": len(devices)}))


def layouts(path, op):
    """A `Stack` or `Unstack` restore of the params (8 layers of 8 MiB), measured."""
    per_layer = jax.eval_shape(state)["model"]
    if op == "save_stacked":
        layers = state()["model"]["layers"]
        eqxckpt.save(path, {"model": {"layers": {n: jnp.stack([x[n] for x in layers]) for n in ("w", "b")}}})
        print(json.dumps({"peak": 0, "bytes": 0}))
        return
    if op == "load_stacked":
        layers = per_layer["layers"]
        like = {
            "layers": {n: jax.ShapeDtypeStruct((len(layers), *layers[0][n].shape), jnp.float32) for n in ("w", "b")}
        }
        transforms = {r"layers/(.*)": eqxckpt.Stack(r"layers/{i}/\1")}
    else:
        like, transforms = per_layer, {r"layers/(\d+)/(.*)": eqxckpt.Unstack(r"layers/\2", index=r"\1")}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = kib("VmRSS")
    out = jax.block_until_ready(eqxckpt.load(path, like, at="model", transforms=transforms))
    peak = (kib("VmHWM") - before) * 1024
    layers = state()["model"]["layers"]
    for i, layer in enumerate(layers):  # every value
        for n in ("w", "b"):
            got = out["layers"][n][i] if op == "load_stacked" else out["layers"][i][n]
            assert np.array_equal(got, layer[n]), (i, n)
    print(json.dumps({"peak": peak, "bytes": sum(x.nbytes for x in jax.tree_util.tree_leaves(out))}))


def main(op, path, *args):
    if op in ("save_stacked", "load_stacked", "load_unstacked"):
        layouts(path, op)
        return
    if op in ("save_large", "load_sharded"):
        large(path, op, *args)
        return
    if op in ("save_big", "load_big"):
        big(path, op, *args)
        return
    if op in ("save_leaf", "load_leaf"):
        one_leaf(path, op, *args)
        return

    def nbytes(t):
        return sum(x.nbytes for x in jax.tree_util.tree_leaves(t))

    if op in ("copy", "to_safetensors", "from_safetensors"):  # PATH is the source; the copy goes beside it
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = kib("VmRSS")
        source = eqxckpt.open(path + ".safetensors" if op == "from_safetensors" else path)
        if op == "to_safetensors":
            eqxckpt.save_safetensors(path + ".safetensors", source.tree())
        else:
            eqxckpt.save(path + "-" + op, source.tree())
        print(json.dumps({"peak": (kib("VmHWM") - before) * 1024, "bytes": source.nbytes}))
        return
    if op.startswith("load"):
        # The state is built only after the load, to check it: memory it
        # freed would otherwise be reused and hide the load's own growth.
        like = jax.eval_shape(state)
        like = like["model"] if op == "load_params" else like
    else:
        tree = state()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak
    before = kib("VmRSS")
    if op == "save":
        eqxckpt.save(path, tree)
        size = nbytes(tree)
    elif op == "save_async":
        eqxckpt.save(path, tree, blocking=False).wait()
        size = nbytes(tree)
    else:
        out = eqxckpt.load(path, like, at="model" if op == "load_params" else None)
        size = nbytes(out)
    peak = (kib("VmHWM") - before) * 1024
    if op.startswith("load"):
        expected = state()["model"] if op == "load_params" else state()
        assert all(
            np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(expected))
        )
    print(json.dumps({"peak": peak, "bytes": size}))


if __name__ == "__main__":
    main(*sys.argv[1:])
