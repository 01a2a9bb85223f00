"""One of several JAX processes probing replica-parallel saves and single-read restores
(`eqxckpt._write._shares`, `eqxckpt._read._read_once`) at their edges. Started by tests/test_distributed.py.

    python attack_worker.py SCENARIO PORT NUM_PROCESSES PROCESS_ID DIRECTORY

ATTACK_DEVICES: CPU devices per process (default 1). Each scenario prints lines
``RESULT <json>`` that the test reads.
"""

import json
import os
import pathlib
import sys
import time
import zlib

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DEVICES = int(os.environ.get("ATTACK_DEVICES", "1"))


def result(**values) -> None:
    print("RESULT " + json.dumps(values), flush=True)


def values(path: str, shape: tuple[int, ...], dtype) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(path.encode()))
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype) if dtype.itemsize >= 1 and dtype.name not in ("int4", "uint4") else None
        lo, hi = (info.min, info.max) if info is not None else ((-8, 7) if dtype.name == "int4" else (0, 15))
        return rng.integers(lo, hi, shape, endpoint=True).astype(dtype)
    if dtype.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def global_array(path: str, shape, dtype, sharding) -> jax.Array:
    value = values(path, shape, dtype)
    return jax.make_array_from_callback(shape, sharding, lambda i: value[i], dtype=value.dtype)


def on_object_store(at: str, act) -> None:
    """Make this process call ``act()`` at one instant of its next object-store save or
    load: ``write`` (before each chunk write), ``read`` (before each chunk read),
    ``commit`` (entering the commit), ``committed`` (just after the manifest's conditional
    write). ``act`` may stop, hold up or kill the process."""
    import eqxckpt._storage._backend as backend
    import eqxckpt._storage._objects as objects

    if at in ("write", "read"):
        name = {"write": "writing", "read": "reading"}[at]
        original = getattr(backend.KvChunkFiles, name)

        async def acting(self, key, buffers):
            act()
            await original(self, key, buffers)

        setattr(backend.KvChunkFiles, name, acting)
    elif at == "commit":
        commit = objects.ObjectStaging.commit
        objects.ObjectStaging.commit = lambda self, *a: (act(), commit(self, *a))[1]
    elif at == "committed":
        write_manifest = objects.write_manifest
        objects.write_manifest = lambda *a: (write_manifest(*a), act())[0]
    else:
        raise ValueError(at)


def check(path: str, restored: jax.Array, want: np.ndarray) -> int:
    """Every element this process holds equals the saved one, bit for bit."""
    checked = 0
    for shard in restored.addressable_shards:
        got = np.asarray(shard.data)
        assert got.dtype == want.dtype, (path, got.dtype, want.dtype)
        assert got.tobytes() == want[shard.index].tobytes(), (path, shard.index)
        checked += got.size
    return checked


def mismatches(path: str, restored: jax.Array, want: np.ndarray) -> int:
    bad = 0
    for shard in restored.addressable_shards:
        got = np.asarray(shard.data)
        bad += int((got != want[shard.index]).sum())
    return bad


def corrupt_chunk(directory: str, leaf: str, key: str) -> None:
    path = os.path.join(directory, leaf, key)
    with open(path, "r+b") as f:
        f.seek(0)
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0xFF]))


# --- scenarios ---------------------------------------------------------------------------


def one_failed_read_then_fallback(directory: str) -> None:
    """Two checkpoints of the same tree (a leaf sharded across processes, one replicated).
    The newer one has a damaged chunk that only process 1 reads (of the sharded leaf);
    a process whose load fails falls back to the older checkpoint, as a training script
    does. Every process must either raise, or return the checkpoint it asked for."""
    from jax.experimental import multihost_utils

    import eqxckpt

    me = jax.process_index()
    mesh = Mesh(np.array(jax.devices()), ("p",))
    rows = 512
    shapes = {"s": ((rows, 256), P("p")), "r": ((rows, 256), P())}

    def tree(tag: str) -> dict:
        return {
            k: global_array(f"{tag}/{k}", shape, np.float32, NamedSharding(mesh, spec))
            for k, (shape, spec) in shapes.items()
        }

    old, new = f"{directory}/old", f"{directory}/new"
    eqxckpt.save(old, tree("old"))
    eqxckpt.save(new, tree("new"))
    multihost_utils.sync_global_devices("saved")
    if me == 0:
        chunks = sorted(os.listdir(f"{new}/s/c"))
        result(chunks=chunks)
        corrupt_chunk(new, "s", f"c/{chunks[-1]}/0")  # the last rows: process 1's shard
    multihost_utils.sync_global_devices("corrupted")
    like = {
        k: jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(mesh, spec))
        for k, (shape, spec) in shapes.items()
    }
    try:
        restored, tag = eqxckpt.load(new, like), "new"
    except eqxckpt.CheckpointError as e:
        result(process=me, raised=type(e).__name__, message=str(e)[:300])
        restored, tag = eqxckpt.load(old, like), "old"
    bad = {k: mismatches(k, restored[k], values(f"{tag}/{k}", shape, np.float32)) for k, (shape, _) in shapes.items()}
    result(process=me, returned=tag, mismatched=bad)


def meshes() -> dict[str, Mesh]:
    devices = np.array(jax.devices())
    n = len(devices)
    out = {"line": Mesh(devices, ("p",))}
    if n % 2 == 0 and n > 2:
        out["square"] = Mesh(devices.reshape(2, n // 2), ("a", "b"))
        out["square_t"] = Mesh(devices.reshape(2, n // 2).T.copy(), ("a", "b"))
    perm = np.random.default_rng(7).permutation(n)
    out["perm"] = Mesh(devices[perm], ("p",))
    if n % 2 == 0 and n > 2:
        out["perm_square"] = Mesh(devices[perm].reshape(2, n // 2), ("a", "b"))
    return out


LEAVES = {
    "f32_big": ((64, 4096), "float32"),  # 1 MiB
    "f32_odd": ((7, 40000), "float32"),  # 1.1 MiB, 7 rows
    "f32_flat": ((300001,), "float32"),
    "bf16": ((96, 2048), "bfloat16"),
    "f16": ((5, 3, 20000), "float16"),
    "bool": ((300000,), "bool"),
    "u8": ((3, 300000), "uint8"),
    "i4": ((64, 8192), "int4"),
    "c64": ((64, 2048), "complex64"),
    "i32_small": ((5,), "int32"),
    "one": ((1,), "float32"),
    "scalar": ((), "float32"),
    "empty": ((0, 4), "float32"),
    "ones": ((1, 1, 100000), "float32"),
    "keys": ((96,), "key"),
    "keys_odd": ((7,), "key"),
}


def _dtype(name: str):
    import jax.numpy as jnp

    return {"bfloat16": jnp.bfloat16, "int4": jnp.int4}.get(name, np.dtype(name) if name != "key" else None)


def expected_of(path: str, shape, kind: str) -> np.ndarray:
    if kind == "key":
        return np.asarray(
            jax.random.key_data(jax.random.split(jax.random.key(zlib.crc32(path.encode()) % 1000), shape[0]))
        )
    return values(path, shape, _dtype(kind))


def spec_for(mesh: Mesh, spec: str, shape) -> P:
    """``spec``: a comma list of mesh axes for dimension 0 ('' replicated); dimension 0 must divide."""
    if not spec or not shape:
        return P()
    axes = tuple(spec.split("+"))
    size = int(np.prod([mesh.shape[a] for a in axes]))
    return P(axes if len(axes) > 1 else axes[0]) if shape[0] % size == 0 and shape[0] else P()


def build(mesh: Mesh, spec: str, leaves=None) -> dict:
    leaves = LEAVES if leaves is None else leaves
    out = {}
    for path, (shape, kind) in leaves.items():
        sharding = NamedSharding(mesh, spec_for(mesh, spec, shape))
        if kind == "key":
            seed = zlib.crc32(path.encode()) % 1000
            out[path] = jax.jit(
                lambda n=shape[0], seed=seed: jax.random.split(jax.random.key(seed), n), out_shardings=sharding
            )()
        else:
            out[path] = global_array(path, shape, _dtype(kind), sharding)
    return out


def skeleton(mesh: Mesh, spec: str, leaves=None) -> dict:
    leaves = LEAVES if leaves is None else leaves
    out = {}
    for path, (shape, kind) in leaves.items():
        dtype = jax.random.key(0).dtype if kind == "key" else _dtype(kind)
        out[path] = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec_for(mesh, spec, shape)))
    return out


def check_tree(restored: dict, like: dict, leaves=None) -> dict:
    leaves = LEAVES if leaves is None else leaves
    bad = {}
    for path, (shape, kind) in leaves.items():
        value = restored[path]
        want = expected_of(path, shape, kind)
        if kind == "key":
            value = jax.random.key_data(value)
        try:
            if value.shape != want.shape:
                raise AssertionError(("shape", value.shape, want.shape))
            if (
                kind != "key"
                and value.sharding != like[path].sharding
                and not value.sharding.is_equivalent_to(like[path].sharding, len(shape))
            ):
                raise AssertionError(("sharding", str(value.sharding), str(like[path].sharding)))
            check(path, value, want)
        except AssertionError as e:
            bad[path] = repr(e)[:200]
    return bad


def matrix(directory: str) -> None:
    """Save under several meshes and specs; restore each onto several others; check every
    element each process holds, bit for bit."""
    from jax.experimental import multihost_utils

    import eqxckpt

    all_meshes = meshes()
    saves = [
        (m, s)
        for m, s in [("line", ""), ("square", "a"), ("square", "b"), ("perm", ""), ("square_t", "a"), ("line", "p")]
        if m in all_meshes
    ]
    loads = [
        (m, s)
        for m, s in [
            ("line", ""),
            ("square", "a"),
            ("square", "b"),
            ("perm", ""),
            ("perm_square", "b"),
            ("square_t", "b"),
            ("line", "p"),
            ("square", "a+b"),
        ]
        if m in all_meshes
    ]
    if os.environ.get("ATTACK_SAVES"):
        saves = [tuple(x.split(":")) for x in os.environ["ATTACK_SAVES"].split(",")]
    if os.environ.get("ATTACK_LOADS"):
        loads = [tuple(x.split(":")) for x in os.environ["ATTACK_LOADS"].split(",")]
    failures = {}
    count = 0
    for sm, ss in saves:
        where = f"{directory}/{sm}_{ss or 'rep'}"
        tree = build(all_meshes[sm], ss)
        eqxckpt.save(where, tree)
        del tree
        multihost_utils.sync_global_devices(f"saved {where}")
        for lm, ls in loads:
            like = skeleton(all_meshes[lm], ls)
            bad = check_tree(eqxckpt.load(where, like), like)
            count += 1
            if bad:
                failures[f"{sm}:{ss} -> {lm}:{ls}"] = bad
    result(process=jax.process_index(), combos=count, failures=failures)


def batches(directory: str) -> None:
    """Several replicated leaves restored in batches of the host memory budget: each
    process's budget (ATTACK_BUDGETS, comma separated, bytes) and the mesh (ATTACK_MESH:
    ``all``, every device; ``uneven``, all but the last device, so the last process holds
    fewer) as given."""
    from jax.experimental import multihost_utils

    import eqxckpt

    me = jax.process_index()
    devices = jax.devices()
    if os.environ.get("ATTACK_MESH", "all") == "uneven":
        devices = devices[:-1]
    mesh = Mesh(np.array(devices), ("p",))
    n = len(devices)
    leaves = {f"r{i}": ((n * 128, 512), "float32") for i in range(4)}
    tree = build(mesh, os.environ.get("ATTACK_SAVE_SPEC", ""), leaves)
    eqxckpt.save(f"{directory}/ckpt", tree)
    del tree
    multihost_utils.sync_global_devices("saved")
    budgets = [int(b) for b in os.environ.get("ATTACK_BUDGETS", "").split(",") if b]
    like = skeleton(mesh, "", leaves)
    start = time.monotonic()
    try:
        restored = eqxckpt.load(f"{directory}/ckpt", like, host_memory_budget=budgets[me] if budgets else None)
    except eqxckpt.CheckpointError as e:
        result(process=me, raised=type(e).__name__, after=round(time.monotonic() - start, 1), message=str(e)[:300])
        return
    result(process=me, failures=check_tree(restored, like, leaves), after=round(time.monotonic() - start, 1))


REPLACE = """
import sys, numpy as np, eqxckpt, eqxckpt._chunks
eqxckpt._chunks.CHUNK_BYTES = 256 * 1024  # two chunks, as the 2-process save of the old one
sys.path.insert(0, {workers!r})
from attack_worker import values
eqxckpt.save({where!r}, {{"r": values("new/r", (512, 256), np.float32)}}, overwrite=True)
"""


def replaced_during_load(directory: str) -> None:
    """A checkpoint replaced (``overwrite=True``, by another job) while the processes load
    it: process 0 has read its part of the old one when process 1 opens the new one. Each
    process must raise, or return one checkpoint whole (old or new), never a mix."""
    import subprocess

    from jax.experimental import multihost_utils

    import eqxckpt

    me = jax.process_index()
    mesh = Mesh(np.array(jax.devices()), ("p",))
    where = f"{directory}/latest"
    sharding = NamedSharding(mesh, P())
    eqxckpt.save(where, {"r": global_array("old/r", (512, 256), np.float32, sharding)})
    multihost_utils.sync_global_devices("saved")
    if me == 1:  # process 0 is in load meanwhile, its part of the old checkpoint read
        time.sleep(2)
        code = REPLACE.format(workers=os.path.dirname(os.path.abspath(__file__)), where=where)
        env = {k: v for k, v in os.environ.items() if not k.startswith("EQXCKPT_")}
        subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)
    like = {"r": jax.ShapeDtypeStruct((512, 256), np.float32, sharding=sharding)}
    try:
        restored = eqxckpt.load(where, like)
    except eqxckpt.CheckpointError as e:
        result(process=me, raised=type(e).__name__, message=str(e)[:300])
        return
    bad = {tag: mismatches("r", restored["r"], values(f"{tag}/r", (512, 256), np.float32)) for tag in ("old", "new")}
    result(process=me, returned=bad)


def disagree(directory: str) -> None:
    """Processes that call `load` together but disagree, one case after another: ``dtype``,
    process 1 asks a replicated leaf as bfloat16 (``cast=True``), process 0 as float32;
    ``mesh``, process 1's mesh lists the devices in another order; ``steps``, each process
    loads another of two checkpoints of the same tree into a leaf sharded across them;
    ``same``, they agree. Each process must raise a CheckpointError, or return its ask
    bit-exact."""
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    import eqxckpt

    me = jax.process_index()
    mesh = Mesh(np.array(jax.devices()), ("p",))
    shape = (512, 256)
    for tag in ("a", "b"):
        eqxckpt.save(f"{directory}/{tag}", {"r": global_array(f"{tag}/r", shape, np.float32, NamedSharding(mesh, P()))})
    multihost_utils.sync_global_devices("saved")
    for case in ("dtype", "mesh", "steps", "same"):
        tag, dtype, load_mesh, spec = "a", np.float32, mesh, P()
        if case == "dtype" and me == 1:
            dtype = jnp.bfloat16
        if case == "mesh" and me == 1:
            load_mesh = Mesh(np.array(jax.devices()[::-1]), ("p",))
        if case == "steps":
            tag, spec = "ab"[me % 2], P("p")
        like = {"r": jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(load_mesh, spec))}
        try:
            restored = jax.block_until_ready(eqxckpt.load(f"{directory}/{tag}", like, cast=True))
        except eqxckpt.CheckpointError as e:
            result(case=case, process=me, raised=type(e).__name__, message=str(e)[:400])
            continue
        want = values(f"{tag}/r", shape, np.float32).astype(dtype)
        result(case=case, process=me, mismatched=mismatches("r", restored["r"], want))


def _host_copies(directory: str, saved_at: str) -> tuple[int, dict]:
    """Save the good checkpoint (one replicated leaf) at ``directory/saved_at``, under
    ``directory/good``, and copy ``good`` to ``host0`` and ``host1`` (each process loads
    its host's copy, as on local disks). Returns this process's index and the `like`."""
    import shutil

    from jax.experimental import multihost_utils

    import eqxckpt

    me = jax.process_index()
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("p",)), P())
    eqxckpt.save(f"{directory}/{saved_at}", {"r": global_array("good/r", SHAPE, np.float32, sharding)})
    multihost_utils.sync_global_devices("saved")
    if me == 0:
        for p in range(2):
            shutil.copytree(f"{directory}/good", f"{directory}/host{p}")
    multihost_utils.sync_global_devices("copied")
    return me, {"r": jax.ShapeDtypeStruct(SHAPE, np.float32, sharding=sharding)}


def _attempts(me: int, loads: list) -> None:
    """Each load in turn: the error it raised, or how many elements it got wrong."""
    import eqxckpt

    for attempt, load in enumerate(loads):
        start = time.monotonic()
        try:
            restored = jax.block_until_ready(load())
        except eqxckpt.CheckpointError as e:
            after = round(time.monotonic() - start, 1)
            result(attempt=attempt, process=me, raised=type(e).__name__, after=after, message=str(e)[:300])
            continue
        after = round(time.monotonic() - start, 1)
        mismatched = mismatches("r", restored["r"], values("good/r", SHAPE, np.float32))
        result(attempt=attempt, process=me, mismatched=mismatched, after=after)


SHAPE = (512, 256)


def one_sided_failure(directory: str) -> None:
    """Process 1's own copy of the checkpoint has a damaged manifest: its load fails as it
    opens it, before any phase, while process 0 waits for it. Then both load a good
    checkpoint together."""
    from jax.experimental import multihost_utils

    import eqxckpt

    me, like = _host_copies(directory, "good")
    if me == 0:
        with open(f"{directory}/host1/eqxckpt.json", "w") as f:
            f.write("{")
    multihost_utils.sync_global_devices("damaged")
    _attempts(
        me, [lambda where=where: eqxckpt.load(where, like) for where in (f"{directory}/host{me}", f"{directory}/good")]
    )


def signalled(directory: str) -> None:
    """A job's CheckpointManager (step 0 committed) in which process ATTACK_VICTIM sends
    itself ATTACK_SIGNAL (KILL or STOP) at ATTACK_AT: ``write``, its first chunk write of
    step 1's save; ``commit``, process 0 as it commits step 1; ``read``, its first chunk
    read of a load of step 0 (replicated: read once in all); ``move``, as that load moves
    the parts between processes. ATTACK_STORE (a kvstore spec): the run is on that object
    store, and the chunk I/O and commit hooked are its own. Every other process reports what
    it raised (or returned) and how long it took, then ends at once (its peer is gone: no
    orderly shutdown)."""
    import signal

    import eqxckpt
    import eqxckpt._read._read_once as read_once
    import eqxckpt._storage._disk as local

    me = jax.process_index()
    victim, at = int(os.environ["ATTACK_VICTIM"]), os.environ["ATTACK_AT"]
    number = getattr(signal, f"SIG{os.environ['ATTACK_SIGNAL']}", None)
    mesh = Mesh(np.array(jax.devices()), ("p",))
    shape = (1024, 256)  # 1 MiB: replicated, its chunks split among the 4 processes

    def tree(tag: str) -> dict:
        return {
            k: global_array(f"{tag}/{k}", shape, np.float32, NamedSharding(mesh, spec)) for k, spec in SPECS.items()
        }

    store = os.environ.get("ATTACK_STORE")  # a kvstore spec of the run's directory, on an object store
    run = json.loads(store) if store else f"{directory}/run"
    manager = eqxckpt.CheckpointManager(run, blocking=True, save_on_preemption=False)
    manager.save(0, tree("step0"))

    signalled = []

    def stop_here(*_):
        if not signalled:  # once
            signalled.append(at)
            result(process=me, signalling=at)
            if number is None:  # SLOW: held up, not stopped
                time.sleep(float(os.environ.get("ATTACK_SLOW_S", "8")))
            else:
                os.kill(os.getpid(), number)

    if me == victim and store:
        if at == "move":
            identity = read_once._identity
            read_once._identity = lambda *v: (stop_here(), identity(*v))[1]
        else:
            on_object_store(at, stop_here)
    elif me == victim:
        if at == "write":
            original = local.LocalChunkFiles.write
            local.LocalChunkFiles.write = lambda self, key, pieces: (stop_here(), original(self, key, pieces))[1]
        elif at == "commit":
            commit = local.LocalStaging.commit
            local.LocalStaging.commit = lambda self, *a: (stop_here(), commit(self, *a))[1]
        elif at == "read":
            read = local.LocalChunkFiles.read
            local.LocalChunkFiles.read = lambda self, key, into: (stop_here(), read(self, key, into))[1]
        elif at == "move":
            identity = read_once._identity
            read_once._identity = lambda *v: (stop_here(), identity(*v))[1]
    start = time.monotonic()
    try:
        if at in ("write", "commit"):
            manager.save(1, tree("step1"))
            outcome = {"returned": "saved"}
        else:
            like = {k: jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(mesh, P())) for k in SPECS}
            restored = jax.block_until_ready(manager.load(like, step=0))
            outcome = {
                "returned": {k: mismatches(k, restored[k], values(f"step0/{k}", shape, np.float32)) for k in SPECS}
            }
    except Exception as e:  # noqa: BLE001 - reported, whatever it is
        outcome = {"raised": type(e).__name__, "message": str(e)[:400]}
    result(process=me, after=round(time.monotonic() - start, 1), **outcome)
    sys.stdout.flush()
    pathlib.Path(directory, f"reported-{me}").touch()
    if me == 0:
        # The coordination service lives in process 0: ending it ends every process still
        # waiting in a barrier (a loaded machine's slower one) before it reports.
        others = [pathlib.Path(directory, f"reported-{p}") for p in range(jax.process_count()) if p not in (0, victim)]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(path.exists() for path in others):
            time.sleep(0.05)
    os._exit(0)


def manager_one_sided(directory: str) -> None:
    """As `one_sided_failure`, through each host's CheckpointManager: process 1's copy of
    the latest step gets a damaged manifest after the managers listed their steps, so its
    `CheckpointManager.load` fails as it opens the step, before `load`. Then both load the
    good copy together."""
    from jax.experimental import multihost_utils

    import eqxckpt

    me, like = _host_copies(directory, "good/0")
    managers = [eqxckpt.CheckpointManager(f"{directory}/{where}") for where in (f"host{me}", "good")]
    multihost_utils.sync_global_devices("listed")
    if me == 0:
        with open(f"{directory}/host1/0/eqxckpt.json", "w") as f:
            f.write("{")
    multihost_utils.sync_global_devices("damaged")
    _attempts(me, [lambda manager=manager: manager.load(like) for manager in managers])


def one_process_leaves(directory: str) -> None:
    """Leaves placed on one process's devices only (as a pipeline stage's are), each
    process's in turn, also on one device of the other process: saved together, loaded
    together; and a host-local leaf each process holds its own copy of (process 0's is
    saved)."""
    import eqxckpt

    me = jax.process_index()

    def on(owner: int, count: int | None = None):
        devices = [d for d in jax.devices() if d.process_index == owner][:count]
        return NamedSharding(Mesh(np.array(devices), ("x",)), P("x"))

    def remote_single(owner: int):
        device = [d for d in jax.devices() if d.process_index == owner][-1]
        return jax.sharding.SingleDeviceSharding(device)

    everywhere = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
    shardings = {
        "on0": on(0),
        "on1": on(1),
        "single0": remote_single(0),
        "single1": remote_single(1),
        "everywhere": everywhere,
    }
    tree = {name: global_array(name, (8, 4), "float32", sharding) for name, sharding in shardings.items()}
    tree["local"] = jax.device_put(np.full((3,), me, np.float32), jax.local_devices()[0])
    try:
        eqxckpt.save(f"{directory}/c", tree)
    except eqxckpt.CheckpointError as e:
        result(saved=False, error=f"{type(e).__name__}: {e}"[:800])
        return
    like = {name: jax.ShapeDtypeStruct((8, 4), np.float32, sharding=s) for name, s in shardings.items()}
    for only in (None, "on0", "on1"):
        wanted = {**like, "local": np.zeros(3, np.float32)} if only is None else like[only]
        try:
            out = eqxckpt.load(f"{directory}/c", wanted, at=only)
        except eqxckpt.CheckpointError as e:
            result(loaded=only, error=f"{type(e).__name__}: {e}"[:800])
            continue
        if only is not None:
            out = {only: out}
        wrong = {name: mismatches(name, out[name], values(name, (8, 4), "float32")) for name in like if name in out}
        result(loaded=only, wrong=wrong)
    # Read once across the processes (replicated over them), into pinned host memory.
    mesh = Mesh(np.array(jax.devices()), ("x",))
    pinned = jax.ShapeDtypeStruct((8, 4), np.float32, sharding=NamedSharding(mesh, P(), memory_kind="pinned_host"))
    try:
        out = eqxckpt.load(f"{directory}/c", pinned, at="everywhere")
        kinds = sorted({s.data.sharding.memory_kind for s in out.addressable_shards})
        result(pinned=kinds, wrong=mismatches("everywhere", out, values("everywhere", (8, 4), "float32")))
    except eqxckpt.CheckpointError as e:
        result(pinned="error", error=f"{type(e).__name__}: {e}"[:800])
    result(saved=True)


SPECS = {"r": P(), "s": P("p")}


SCENARIOS = {
    f.__name__: f
    for f in [
        one_failed_read_then_fallback,
        matrix,
        batches,
        replaced_during_load,
        disagree,
        one_sided_failure,
        signalled,
        manager_one_sided,
        one_process_leaves,
    ]
}


if __name__ == "__main__":
    from distributed_worker import run_scenarios

    run_scenarios(SCENARIOS, DEVICES)
