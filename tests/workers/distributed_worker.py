"""One process of a multi-process JAX job, started by tests/test_distributed.py.

    python distributed_worker.py SCENARIO PORT NUM_PROCESSES PROCESS_ID DIRECTORY

Every process builds the same global state from fixed numbers, so each can
check the slices it holds against the numpy values exactly. Importing this
module (as the test does, for `expected` and `make_state`) starts nothing.
"""

import json
import os
import sys
import time
import traceback
import zlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DEVICES_PER_PROCESS = 2


def make_model() -> eqx.nn.MLP:
    return eqx.nn.MLP(in_size=8, out_size=4, width_size=16, depth=1, key=jax.random.key(0))


def make_state() -> dict:
    """The saved tree's structure: an Equinox model, its optax state, and host-local leaves."""
    model = make_model()
    opt_state = optax.adam(1e-3).init(eqx.filter(model, eqx.is_array))
    keys = jax.random.split(jax.random.key(0), 8)  # typed PRNG keys, sharded when saved
    return {"model": model, "opt_state": opt_state, "step": 7, "host": np.arange(5, dtype=np.int64), "keys": keys}


def expected_key_data() -> np.ndarray:
    return np.asarray(jax.random.key_data(jax.random.split(jax.random.key(0), 8)))


def expected(path: str, shape: tuple, dtype) -> np.ndarray:
    """The value every process agrees a leaf holds (seeded by its path)."""
    rng = np.random.default_rng(zlib.crc32(path.encode()))
    if np.issubdtype(dtype, np.integer):
        return rng.integers(0, 1000, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def save_spec(path: str) -> P:
    """How leaves are laid out when saving, on the (processes, 2) mesh ("data", "model")."""
    if path.endswith("layers/0/weight"):  # (16, 8): sharded both ways
        return P("data", "model")
    if path.endswith("layers/0/bias"):  # (16,)
        return P("model")
    if path.endswith("layers/1/weight"):  # (4, 16): one axis across every device
        return P(None, ("data", "model"))
    return P()  # replicated everywhere (layers/1/bias)


def load_spec(path: str) -> P:
    """A different layout on a different mesh, (2, processes) ("a", "b"), devices reversed."""
    if path.endswith("layers/0/weight"):
        return P("b", None)
    if path.endswith("layers/0/bias"):
        return P()  # sharded -> replicated
    if path.endswith("layers/1/weight"):
        return P(None, "a")
    return P("a")  # replicated -> sharded (layers/1/bias, (4,))


def global_state(mesh: Mesh | None) -> dict:
    """The state as global arrays laid out by `save_spec` (plain arrays if ``mesh`` is
    None); ``count`` stays host-local."""
    from eqxckpt._tree import flatten

    flat, treedef = flatten(make_state())
    leaves = []
    for path, _, leaf in flat:
        if path == "keys":
            if mesh is not None:
                split = jax.jit(
                    lambda: jax.random.split(jax.random.key(0), 8), out_shardings=NamedSharding(mesh, P("data"))
                )
                leaf = split()
        elif (
            mesh is not None
            and isinstance(leaf, jax.Array)
            and path.startswith(("model", "opt_state/0/mu", "opt_state/0/nu"))
        ):
            value = expected(path, leaf.shape, leaf.dtype)
            leaf = jax.make_array_from_callback(
                value.shape, NamedSharding(mesh, save_spec(path)), lambda i, v=value: v[i]
            )
        elif isinstance(leaf, (jax.Array, np.ndarray)):
            value = expected(path, leaf.shape, leaf.dtype)
            leaf = value if isinstance(leaf, np.ndarray) else jnp.asarray(value)
        leaves.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def skeleton(mesh: Mesh, save_specs: bool = False) -> dict:
    """`like` for restoring onto ``mesh`` with `load_spec` shardings (`save_spec` ones if ``save_specs``)."""
    from eqxckpt._tree import flatten

    flat, treedef = flatten(eqx.filter_eval_shape(make_state))
    leaves = []
    for path, _, leaf in flat:
        if isinstance(leaf, jax.ShapeDtypeStruct) and path.startswith(("model", "opt_state/0/mu", "opt_state/0/nu")):
            spec = save_spec(path) if save_specs else load_spec(path)
            leaf = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec))
        elif path == "keys":  # sharded one way when saved, another way here
            spec = P("data") if save_specs else P("b")
            leaf = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec))
        elif path == "host":  # filter_eval_shape would turn the int64 numpy leaf into int32
            leaf = np.zeros(leaf.shape, np.int64)
        leaves.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def check(tree: dict, mesh: Mesh | None = None) -> int:
    """Assert every value (every slice this process holds) equals `expected`; count elements checked."""
    from eqxckpt._tree import flatten

    checked = 0
    for path, _, leaf in flatten(tree)[0]:
        if path == "step":
            assert leaf == 7, leaf
            continue
        if path == "keys":
            want = expected_key_data()
            if mesh is not None:
                assert leaf.sharding == NamedSharding(mesh, P("b")), leaf.sharding
            for shard in leaf.addressable_shards:
                np.testing.assert_array_equal(np.asarray(jax.random.key_data(shard.data)), want[shard.index])
                checked += shard.data.size
            continue
        if not hasattr(leaf, "shape"):
            continue
        want = expected(path, leaf.shape, leaf.dtype)
        if isinstance(leaf, jax.Array):
            if mesh is not None and path.startswith(("model", "opt_state/0/mu", "opt_state/0/nu")):
                assert leaf.sharding == NamedSharding(mesh, load_spec(path)), (path, leaf.sharding)
            for shard in leaf.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index], err_msg=path)
                checked += shard.data.size
        else:
            np.testing.assert_array_equal(leaf, want, err_msg=path)
            checked += leaf.size
    return checked


LAYERS, ROWS, COLUMNS = 4, 8, 16  # the layout scenario's layers, each (ROWS, COLUMNS) float32


def layer_values(i: int) -> np.ndarray:
    return np.arange(ROWS * COLUMNS, dtype=np.float32).reshape(ROWS, COLUMNS) + 1000 * i


def layout_scenario(process_id: int, num_processes: int, devices: np.ndarray, directory: str) -> None:
    """Restore DIRECTORY/per_layer into a skeleton stacked along the layers, sharded by layer
    over every device, and DIRECTORY/stacked into per-layer leaves sharded by rows; print
    each restore's chunk files read by this process (JSON) once every value is checked."""
    import eqxckpt
    import eqxckpt._storage._disk as local

    read: list[str] = []

    class Counted(local.LocalChunkFiles):
        def _read_ranges(self, key, ranges, size):
            read.append(key)  # every read of a local chunk file, in one range or a slab at a time
            super()._read_ranges(key, ranges, size)

    local.LocalChunkFiles = Counted  # type: ignore[misc]
    line = Mesh(devices, ("x",))
    stack = {r"blocks/(.*)": eqxckpt.Stack(r"blocks/{i}/\1")}
    like = {
        "blocks": {
            "w": jax.ShapeDtypeStruct((LAYERS, ROWS, COLUMNS), jnp.float32, sharding=NamedSharding(line, P("x")))
        }
    }
    out = eqxckpt.load(f"{directory}/per_layer", like, transforms=stack)["blocks"]["w"]
    for shard in out.addressable_shards:
        expected = np.stack([layer_values(i) for i in range(LAYERS)])[shard.index]
        np.testing.assert_array_equal(np.asarray(shard.data), expected)
    print(f"process {process_id}: stack read {json.dumps(sorted(read))}", flush=True)
    read.clear()
    unstack = {r"blocks/(\d+)/(.*)": eqxckpt.Unstack(r"blocks/\2", index=r"\1")}
    rows = NamedSharding(line, P("x", None))
    like = {"blocks": [{"w": jax.ShapeDtypeStruct((ROWS, COLUMNS), jnp.float32, sharding=rows)} for _ in range(LAYERS)]}
    out = eqxckpt.load(f"{directory}/stacked", like, transforms=unstack)
    for i in range(LAYERS):
        for shard in out["blocks"][i]["w"].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), layer_values(i)[shard.index])
    print(f"process {process_id}: unstack read {json.dumps(sorted(read))}", flush=True)


def _pin_gloo_to_loopback() -> None:
    """Gloo binds to whatever the hostname resolves to; these tests use 127.0.0.1 only."""
    from jax._src.lib import _jax

    make = _jax.make_gloo_tcp_collectives
    _jax.make_gloo_tcp_collectives = lambda distributed_client, **_: make(distributed_client, hostname="127.0.0.1")


def join(port: int, processes: int, process_id: int) -> None:
    """Join the job's coordination service on 127.0.0.1 (gloo pinned to loopback too)."""
    _pin_gloo_to_loopback()
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        coordinator_bind_address=f"127.0.0.1:{port}",
        num_processes=processes,
        process_id=process_id,
        initialization_timeout=60,
        heartbeat_timeout_seconds=10,
    )


def main(scenario: str, port: int, num_processes: int, process_id: int, directory: str) -> None:
    jax.config.update("jax_num_cpu_devices", DEVICES_PER_PROCESS)
    join(port, num_processes, process_id)
    import eqxckpt

    devices = np.array(jax.devices())
    save_mesh = Mesh(devices.reshape(num_processes, DEVICES_PER_PROCESS), ("data", "model"))
    load_mesh = Mesh(devices[::-1].reshape(DEVICES_PER_PROCESS, num_processes), ("a", "b"))

    if scenario == "save":
        state = global_state(save_mesh)
        eqxckpt.save(f"{directory}/blocking", state, metadata={"processes": num_processes})
        handle = eqxckpt.save(f"{directory}/async", state, blocking=False)
        # The caller keeps computing on the saved arrays while the save runs.
        doubled = jax.tree_util.tree_map(lambda x: x * 2, eqx.filter(state["model"], eqx.is_array))
        handle.wait()
        jax.block_until_ready(doubled)
        for name in ("blocking", "async"):
            restored = eqxckpt.load(f"{directory}/{name}", skeleton(load_mesh))
            print(f"process {process_id}: {name} restored, {check(restored, load_mesh)} elements checked")
        # Replacing needs overwrite=True, and every process gets process 0's verdict.
        try:
            eqxckpt.save(f"{directory}/blocking", state)
        except eqxckpt.CheckpointExistsError as e:
            assert "Process 0" in str(e) or process_id == 0, e
        else:
            raise AssertionError("saving over a checkpoint without overwrite=True succeeded")
        eqxckpt.save(f"{directory}/blocking", state, overwrite=True, metadata={"overwritten": True})
        assert eqxckpt.open(f"{directory}/blocking").metadata == {"overwritten": True}
        if os.environ.get("S3_TEST_ENDPOINT"):  # the same, to an S3 server (moto, on 127.0.0.1)
            where = {
                "driver": "s3",
                "bucket": os.environ["S3_TEST_BUCKET"],
                "path": f"mp{num_processes}/",
                "endpoint": os.environ["S3_TEST_ENDPOINT"],
                "aws_region": "us-east-1",
                "aws_credentials": {"type": "environment"},
            }
            eqxckpt.save(where, state, blocking=False).wait()
            restored = eqxckpt.load(where, skeleton(load_mesh))
            print(f"process {process_id}: s3 restored, {check(restored, load_mesh)} elements checked")
        if os.environ.get("GCS_TEST_BUCKET"):  # and to Cloud Storage (fake-gcs-server, on 127.0.0.1)
            where = {"driver": "gcs", "bucket": os.environ["GCS_TEST_BUCKET"], "path": f"mp{num_processes}/"}
            eqxckpt.save(where, state, blocking=False).wait()
            restored = eqxckpt.load(where, skeleton(load_mesh))
            print(f"process {process_id}: gcs restored, {check(restored, load_mesh)} elements checked")
    elif scenario == "manager":  # every process drives the same manager; process 0 alone deletes
        state = global_state(save_mesh)
        with eqxckpt.CheckpointManager(f"{directory}/run", max_to_keep=2, keep_every=3) as manager:
            for step in range(7):
                manager.save(step, state, metrics={"loss": float(step)})
        assert manager.all_steps() == [0, 3, 5, 6], manager.all_steps()
        # Incremental: the leaf process 0 writes whole is linked from step to step; the
        # sharded ones (no digest: no one process holds them) are written by every step.
        inode = lambda step, leaf: os.stat(f"{directory}/run/{step}/{leaf}").st_ino  # noqa: E731
        assert inode(5, "host/c/0") == inode(6, "host/c/0") == inode(3, "host/c/0")
        assert inode(5, "model/layers/0/weight/zarr.json") != inode(6, "model/layers/0/weight/zarr.json")
        restored = manager.load(skeleton(load_mesh))
        print(
            f"process {process_id}: manager steps {manager.all_steps()}, {check(restored, load_mesh)} elements checked"
        )
    elif scenario == "load":  # checkpoints written by other process counts, restored across these
        # ELASTIC_SOURCES: a JSON list of locations (paths or kvstore specs); default: DIRECTORY/single.
        sources = json.loads(os.environ.get("ELASTIC_SOURCES", "null")) or [f"{directory}/single"]
        for i, where in enumerate(sources):
            restored = eqxckpt.load(where, skeleton(load_mesh))
            print(f"process {process_id}: source {i} restored, {check(restored, load_mesh)} elements checked")
    elif scenario == "preempt":  # a training run that a SIGTERM to one process stops on every process
        steps = int(os.environ.get("PREEMPT_STEPS", "30"))
        state = global_state(save_mesh)
        train = eqx.filter_jit(lambda tree, step: jax.tree_util.tree_map(lambda x: x * 0.5 + step, tree))
        with eqxckpt.CheckpointManager(f"{directory}/run", save_interval_steps=10) as manager:
            start = manager.latest_step()
            if start is not None:
                state = manager.load(skeleton(save_mesh, save_specs=True))
                print(f"process {process_id}: resumed from {start}", flush=True)
            for step in range(0 if start is None else start + 1, steps):
                state["model"] = eqx.combine(train(eqx.filter(state["model"], eqx.is_array), step), state["model"])
                manager.save(step, state)
                print(f"process {process_id}: step {step}", flush=True)
                time.sleep(0.05)
        print(f"process {process_id}: done", flush=True)
    elif scenario == "layout":  # Stack and Unstack across processes: each reads only its own slices
        layout_scenario(process_id, num_processes, devices, directory)
    elif scenario == "crash":  # process 1 dies before saving: the others must not hang
        if process_id == 1:
            raise RuntimeError("worker 1 crashed on purpose")
        time.sleep(60)
    else:
        raise ValueError(scenario)


def run_worker(main) -> None:
    """Every worker's entry point: ``main(SCENARIO, PORT, NUM_PROCESSES, PROCESS_ID,
    DIRECTORY)`` from the command line; any failure ends the process at once (the
    others must not wait on it), a clean ``SystemExit`` (a preempted manager's) does not."""
    try:
        main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    except SystemExit as e:
        if e.code not in (0, None):
            os._exit(1)
    except BaseException:  # noqa: BLE001 - any failure must end this process at once
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    jax.distributed.shutdown()


def run_scenarios(scenarios: dict, devices: int = 1) -> None:
    """The entry point of a worker of named scenarios (`run_worker`'s command line): join
    the others with ``devices`` CPU devices each, run ``scenarios[SCENARIO](DIRECTORY)``,
    then print ``RESULT {"process": ..., "done": seconds}``."""

    def main(scenario: str, port: int, processes: int, process_id: int, directory: str) -> None:
        jax.config.update("jax_num_cpu_devices", devices)
        join(port, processes, process_id)
        start = time.monotonic()
        scenarios[scenario](directory)
        print("RESULT " + json.dumps({"process": process_id, "done": round(time.monotonic() - start, 1)}), flush=True)

    run_worker(main)


if __name__ == "__main__":
    run_worker(main)
