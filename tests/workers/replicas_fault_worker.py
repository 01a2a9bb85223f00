"""One of several JAX processes (one CPU device each) probing replica-parallel
saves and single-read restores on object stores (S3 via moto, GCS via fake-gcs-server).
Started by tests/test_replicas_faults.py.

    python replicas_fault_worker.py SCENARIO PORT NUM_PROCESSES PROCESS_ID DIRECTORY

ATTACK_STORE: a kvstore spec (JSON) of the run directory. Every scenario prints lines
``RESULT <json>``.
"""

import json
import os
import sys
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attack_worker import global_array, mismatches, on_object_store, result, values  # noqa: E402

SHAPE = (1536, 256)  # 1.5 MiB of float32: rows divide by 2, 3, 4
SPECS = {"r": P(), "s": P("p")}


def _store() -> dict:
    return json.loads(os.environ["ATTACK_STORE"])


def _tree(mesh: Mesh, tag: str, shape=SHAPE) -> dict:
    return {k: global_array(f"{tag}/{k}", shape, np.float32, NamedSharding(mesh, spec)) for k, spec in SPECS.items()}


def _like(mesh: Mesh, spec=None, shape=SHAPE) -> dict:
    spec = P() if spec is None else spec
    return {k: jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(mesh, spec)) for k in SPECS}


def _outcome(call) -> dict:
    start = time.monotonic()
    try:
        value = call()
        out = {"returned": value}
    except Exception as e:  # noqa: BLE001 - reported, whatever it is
        import eqxckpt

        out = {"raised": type(e).__name__, "message": str(e)[:600], "ours": isinstance(e, eqxckpt.CheckpointError)}
    out["after"] = round(time.monotonic() - start, 1)
    return out


def lost(directory: str) -> None:
    """Step 0 committed by a manager on an object store; process ATTACK_VICTIM SIGKILLs
    itself at ATTACK_AT during step 1's save: ``write`` (its first chunk write), ``commit``
    (entering the commit), ``committed`` (just after the manifest's conditional write).
    The others report what they raised and when."""
    import signal

    import eqxckpt

    me = jax.process_index()
    victim, at = int(os.environ["ATTACK_VICTIM"]), os.environ["ATTACK_AT"]
    mesh = Mesh(np.array(jax.devices()), ("p",))
    manager = eqxckpt.CheckpointManager(_store(), blocking=True, save_on_preemption=False)
    manager.save(0, _tree(mesh, "step0"))

    def die() -> None:
        result(process=me, dying=at)
        os.kill(os.getpid(), signal.SIGKILL)

    if me == victim:
        on_object_store(at, die)
    out = _outcome(lambda: (manager.save(1, _tree(mesh, "step1")), "saved")[1])
    result(process=me, **out)
    sys.stdout.flush()
    os._exit(0)


def resave(directory: str) -> None:
    """A fresh job (after `lost`) resumes: it saves step 1 again through a manager, then
    loads every step it lists and checks it bit for bit."""
    import eqxckpt

    me = jax.process_index()
    mesh = Mesh(np.array(jax.devices()), ("p",))
    manager = eqxckpt.CheckpointManager(_store(), blocking=True, save_on_preemption=False)
    result(process=me, steps_before=manager.all_steps())
    out = _outcome(lambda: (manager.save(1, _tree(mesh, "step1b")), "saved")[1])
    result(process=me, phase="resave", **out)
    steps = manager.all_steps()
    checked = {}
    for step in steps:
        tag = {0: "step0", 1: "step1"}[step]
        got = _outcome(lambda step=step: jax.block_until_ready(manager.load(_like(mesh), step=step)))
        if "returned" in got:
            # step 1 may be the lost save's (rolled forward) or the resave's
            bad = {
                t: sum(mismatches(k, got["returned"][k], values(f"{t}/{k}", SHAPE, np.float32)) for k in SPECS)
                for t in ((tag, "step1b") if step == 1 else (tag,))
            }
            checked[step] = bad
        else:
            checked[step] = got
    result(process=me, steps=steps, checked=checked)


def replaced(directory: str) -> None:
    """A replicated leaf restored read-once from an object store; just before process 1's
    first chunk read, ATTACK_FAULT happens to the checkpoint: ``overwrite`` (another job
    saves over it with overwrite=True: the old prefix is retired and deleted), ``garbage``
    (each chunk object of ``r`` rewritten with other bytes of the same size), ``truncate``
    (the same, one byte shorter), ``delete`` (the chunk objects of ``r`` deleted). Each
    process reports what it raised, or how many elements it got wrong against the old and
    the new values."""
    import subprocess

    from jax.experimental import multihost_utils

    import eqxckpt

    me = jax.process_index()
    fault = os.environ["ATTACK_FAULT"]
    mesh = Mesh(np.array(jax.devices()), ("p",))
    where = {**_store(), "path": _store()["path"] + "ckpt/"}
    eqxckpt.save(where, {"r": global_array("old/r", SHAPE, np.float32, NamedSharding(mesh, P()))})
    multihost_utils.sync_global_devices("saved")
    if me == 1:
        first = []

        def fault_once() -> None:
            if not first:
                first.append(fault)
                result(process=me, faulting=fault)
                code = FAULT.format(workers=os.path.dirname(os.path.abspath(__file__)), where=where, fault=fault)
                env = {k: v for k, v in os.environ.items() if not k.startswith("EQXCKPT_")}
                done = subprocess.run(
                    [sys.executable, "-c", code], env=env, timeout=120, capture_output=True, text=True
                )
                result(process=me, fault_rc=done.returncode, fault_out=(done.stdout + done.stderr)[-800:])

        on_object_store("read", fault_once)
    like = {"r": jax.ShapeDtypeStruct(SHAPE, np.float32, sharding=NamedSharding(mesh, P()))}
    got = _outcome(lambda: jax.block_until_ready(eqxckpt.load(where, like)))
    if "returned" in got:
        restored = got.pop("returned")
        got["mismatched"] = {
            t: mismatches("r", restored["r"], values(f"{t}/r", SHAPE, np.float32)) for t in ("old", "new")
        }
    result(process=me, **got)
    # Then a second load, of whatever is there now, must be exact (or raise for a damaged one).
    multihost_utils.sync_global_devices("again")
    got = _outcome(lambda: jax.block_until_ready(eqxckpt.load(where, like)))
    if "returned" in got:
        restored = got.pop("returned")
        got["mismatched"] = {
            t: mismatches("r", restored["r"], values(f"{t}/r", SHAPE, np.float32)) for t in ("old", "new")
        }
    result(process=me, again=True, **got)


FAULT = """
import sys, json, numpy as np, tensorstore as ts, eqxckpt
sys.path.insert(0, {workers!r})
from attack_worker import values
where, fault = {where!r}, {fault!r}
if fault == "overwrite":
    eqxckpt.save(where, {{"r": values("new/r", (1536, 256), np.float32)}}, overwrite=True)
else:
    kv = ts.KvStore.open(where).result()
    keys = [k.decode() for k in kv.list().result() if b"/r/c/" in k]
    for key in keys:
        value = kv.read(key).result().value
        if fault == "garbage":
            kv.write(key, bytes(b ^ 0x5A for b in value)).result()
        elif fault == "truncate":
            kv.write(key, value[:-1]).result()
        elif fault == "delete":
            kv.delete_range(ts.KvStore.KeyRange(key, key + "\\x00")).result()
    print("faulted", keys)
"""


def budget(directory: str) -> None:
    """A 24 MiB leaf replicated on every process, saved to the store, then restored
    read-once with host_memory_budget=ATTACK_BUDGET; reports VmHWM/VmRSS growth."""
    from jax.experimental import multihost_utils

    import eqxckpt

    me = jax.process_index()
    mesh = Mesh(np.array(jax.devices()), ("p",))
    shape = (24 * 1024, 256)
    where = {**_store(), "path": _store()["path"] + "big/"}
    eqxckpt.save(where, {"r": global_array("big/r", shape, np.float32, NamedSharding(mesh, P()))})
    multihost_utils.sync_global_devices("saved")
    import gc

    gc.collect()
    before = _vm()
    _reset_hwm()
    base = _vm()
    like = {"r": jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(mesh, P()))}
    restored = jax.block_until_ready(eqxckpt.load(where, like, host_memory_budget=int(os.environ["ATTACK_BUDGET"])))
    after = _vm()
    bad = mismatches("r", restored["r"], values("big/r", shape, np.float32))
    result(process=me, before=before, base=base, after=after, mismatched=bad)


def _vm() -> dict:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f.read().splitlines())
    return {k: int(fields[k].split()[0]) // 1024 for k in ("VmHWM", "VmRSS")}  # MiB


def _reset_hwm() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def divergent(directory: str) -> None:
    """A leaf "replicated" on every process whose replicas differ (process k's = the
    values + k, as a host-local array made global, or a nondeterministic reduction):
    saved to ATTACK_STORE (or DIRECTORY/div). Process 0 reports what it saved."""
    from jax.experimental import multihost_utils

    import eqxckpt

    me = jax.process_index()
    mesh = Mesh(np.array(jax.devices()), ("p",))
    store = os.environ.get("ATTACK_STORE")
    where = {**_store(), "path": _store()["path"] + "div/"} if store else f"{directory}/div"
    mine = values("div/r", SHAPE, np.float32) + np.float32(me)
    r = jax.make_array_from_callback(SHAPE, NamedSharding(mesh, P()), lambda i: mine[i])
    out = _outcome(lambda: (eqxckpt.save(where, {"r": r}), "saved")[1])
    multihost_utils.sync_global_devices("saved")
    result(process=me, **out)


ODD = {  # replicated leaves of awkward shapes and dtypes, split among 3 writers
    "a": ((1001, 257), "float32"),
    "b": ((3, 50000), "bfloat16"),
    "c": ((70001,), "int8"),
    "d": ((129, 3, 131), "float16"),
    "e": ((2, 2), "float32"),
}


def odd(directory: str) -> None:
    """Replicated leaves of awkward shapes saved to ATTACK_STORE by every process (each
    writing a share), then restored replicated (read once where it can) and onto rows
    over the processes where they divide; every element checked."""
    import eqxckpt

    me = jax.process_index()
    mesh = Mesh(np.array(jax.devices()), ("p",))
    where = {**_store(), "path": _store()["path"] + "odd/"}
    tree = {k: global_array(f"odd/{k}", shape, _dtype(d), NamedSharding(mesh, P())) for k, (shape, d) in ODD.items()}
    eqxckpt.save(where, tree)
    bad = {}
    for spec in (P(), P("p")):
        like = {}
        for k, (shape, d) in ODD.items():
            use = spec if shape[0] % jax.process_count() == 0 else P()
            like[k] = jax.ShapeDtypeStruct(shape, _dtype(d), sharding=NamedSharding(mesh, use))
        restored = jax.block_until_ready(eqxckpt.load(where, like))
        for k, (shape, d) in ODD.items():
            want = values(f"odd/{k}", shape, _dtype(d))
            for shard in restored[k].addressable_shards:
                if np.asarray(shard.data).tobytes() != want[shard.index].tobytes():
                    bad[f"{k} {spec}"] = str(shard.index)
    result(process=me, odd_bad=bad)


def _dtype(name: str):
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name)) if name == "bfloat16" else np.dtype(name)


def small_differ(directory: str) -> None:
    """Two small leaves replicated on both processes (P()): "a" equal everywhere, "b"
    process k's = 1 + k. WriteShares gives "a" to process 0 and "b" to process 1 (the
    fewest bytes so far); process 0 keeps its own copy of "b" to digest it. Saved to
    DIRECTORY/ckpt; each process reports what happened."""
    import eqxckpt

    me = jax.process_index()
    mesh = Mesh(np.array(jax.devices()), ("p",))
    a = np.arange(16, dtype=np.float32)
    b = np.full(16, 1 + me, np.float32)
    tree = {
        "a": jax.make_array_from_callback(a.shape, NamedSharding(mesh, P()), lambda i: a[i]),
        "b": jax.make_array_from_callback(b.shape, NamedSharding(mesh, P()), lambda i: b[i]),
    }
    try:
        eqxckpt.save(f"{directory}/ckpt", tree)
        out = {"saved": True}
    except eqxckpt.CheckpointError as e:
        out = {"saved": False, "raised": type(e).__name__, "message": str(e)}
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("saved")
    result(process=me, **out)


SCENARIOS = {f.__name__: f for f in [lost, resave, replaced, budget, divergent, small_differ, odd]}


if __name__ == "__main__":
    from distributed_worker import run_scenarios

    run_scenarios(SCENARIOS)
