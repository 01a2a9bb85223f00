"""One process of a training job with a local tier, started by tests/test_local.py.

    python local_tier_worker.py train PORT NUM_PROCESSES PROCESS_ID DIRECTORY

One CPU device per process; the state is sharded across all of them. The state of
step s of a run with seed r is `make_state(r, s)`, so every process can check the
blocks it restores exactly. Environment:

- LOCAL_STORE: the persistent tier (a JSON kvstore spec, or a path; default DIRECTORY/run).
- LOCAL_HOSTS: ``separate`` (each process's local tier in DIRECTORY/host<i>) or ``shared``
  (all in DIRECTORY/shared, beside someone else's files).
- LOCAL_SEED, LOCAL_UNTIL (train up to this step, exclusive), LOCAL_KEEP (local_max_to_keep).
- LOCAL_FROM, LOCAL_FROM_SEED: resume from this persistent step, saved with that seed,
  instead of the newest (then train with LOCAL_SEED: the steps after it saved again).
- LOCAL_INTERVAL_<k>: process k's ``local_interval_steps`` (default 1).
- LOCAL_LIKE: ``replicated`` restores into a replicated skeleton (not the mesh saved from)
  and prints ``REFUSED <paths> <first row>`` for the error it gets.
- LOCAL_FAULT: ``VICTIM:WHERE:STEP``: process VICTIM is SIGKILLed in the local save of
  STEP, ``own`` (its own part, written but not committed), ``copy`` (a peer's copy it
  keeps, the same) or ``offer`` (just after offering its part's files to the peer that copies it).

Prints ``RESUMED <step or None> <elements checked>`` and ``SAVED <step>`` lines.
"""

import json
import os
import signal
import sys
import threading
import zlib

import jax
import numpy as np
from distributed_worker import run_scenarios
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import eqxckpt
from eqxckpt import _distributed, _local
from eqxckpt._write import _save

SHAPES = {"w": (8, 1024), "v": (8, 1024), "b": (8,), "table": (16, 64)}  # sharded on the first axis


def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()), ("data",))


def expected(seed: int, step: int, name: str) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(f"{seed}/{name}".encode()))
    return (rng.standard_normal(SHAPES[name]) + step).astype(np.float32)


def make_state(seed: int, step: int) -> dict:
    sharded = NamedSharding(mesh(), P("data"))
    arrays = {
        name: jax.make_array_from_callback(SHAPES[name], sharded, lambda i, n=name: expected(seed, step, n)[i])
        for name in SHAPES
    }
    replicated = jax.make_array_from_callback((3,), NamedSharding(mesh(), P()), lambda i: np.arange(3.0)[i] * step)
    keys = jax.random.split(jax.random.key(seed + step), jax.process_count())
    keys = jax.make_array_from_callback(keys.shape, sharded, lambda i: keys[i])
    return {"params": arrays, "replicated": replicated, "keys": keys, "step": step, "host": np.arange(4) + seed}


def skeleton(seed: int) -> dict:
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x,
        make_state(seed, 0),
    )


def check(state: dict, seed: int, step: int) -> int:
    """Every block this process holds against ``make_state(seed, step)``; elements checked."""
    want = make_state(seed, step)
    assert state["step"] == step and type(state["step"]) is int, state["step"]
    np.testing.assert_array_equal(state["host"], want["host"])
    checked = 0
    for got, exact in [
        *((state["params"][n], want["params"][n]) for n in SHAPES),
        (state["replicated"], want["replicated"]),
        (jax.random.key_data(state["keys"]), jax.random.key_data(want["keys"])),
    ]:
        assert got.sharding.is_equivalent_to(exact.sharding, got.ndim), (got.sharding, exact.sharding)
        for mine, theirs in zip(got.addressable_shards, exact.addressable_shards):
            assert mine.index == theirs.index
            np.testing.assert_array_equal(np.asarray(mine.data), np.asarray(theirs.data))
            checked += mine.data.size
    return checked


def inject(fault: str) -> None:
    """Arrange for this process to be SIGKILLed at the point ``fault`` names."""
    victim, where, at = fault.split(":")
    if int(victim) != jax.process_index():
        return
    writing = threading.local()
    saving: dict = {}  # the step of the local save in progress
    write, commit, receive = _local.LocalTier.write, _save.SaveInProgress.commit, _local.LocalTier.receive
    local_write, take = _local.LocalCheckpoints._write, _distributed.Phases.take

    def checkpoints_write(self, step, part, follows):
        saving["step"] = step
        return local_write(self, step, part, follows)

    def tier_write(self, info, part):
        writing.doomed = info.step == int(at) and where == "own"
        try:
            return write(self, info, part)
        finally:
            writing.doomed = False

    def doomed_commit(self):
        if getattr(writing, "doomed", False):
            print(f"KILLED in {where} {at}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return commit(self)

    def doomed_receive(self, owner, step, files):
        if where == "copy" and step == int(at):
            # The peer's copy half written, never committed.
            staging = self._directory(owner).sub(str(step)).begin_save([], overwrite=True)
            staging.storage.chunk_files().write(files[0][0], [files[0][1]])
            print(f"KILLED in {where} {at}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return receive(self, owner, step, files)

    def doomed_take(self, key, what):
        if where == "offer" and key.startswith(f"copy/{victim}/") and saving.get("step") == int(at):
            # Its part's files are offered and its peer told: it dies as the peer pulls them,
            # before it can hear that they arrived.
            print(f"KILLED in offer {at}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return take(self, key, what)

    _local.LocalTier.write = tier_write
    _local.LocalTier.receive = doomed_receive
    _local.LocalCheckpoints._write = checkpoints_write
    _save.SaveInProgress.commit = doomed_commit
    _distributed.Phases.take = doomed_take


def train(directory: str) -> None:
    store = os.environ.get("LOCAL_STORE") or f"{directory}/run"
    persistent = json.loads(store) if store.startswith("{") else store
    hosts = os.environ.get("LOCAL_HOSTS", "separate")
    local = f"{directory}/host{jax.process_index()}" if hosts == "separate" else f"{directory}/shared"
    seed, until = int(os.environ.get("LOCAL_SEED", "0")), int(os.environ["LOCAL_UNTIL"])
    if fault := os.environ.get("LOCAL_FAULT"):
        inject(fault)
    with eqxckpt.CheckpointManager(
        persistent,
        save_interval_steps=4,
        local_path=local,
        local_interval_steps=int(os.environ.get(f"LOCAL_INTERVAL_{jax.process_index()}", "1")),
        local_replicas=int(os.environ.get("LOCAL_REPLICAS", "1")),
        local_max_to_keep=int(os.environ.get("LOCAL_KEEP", "1")),
    ) as manager:
        start = manager.latest_step()
        checked = 0
        if start is not None and os.environ.get("LOCAL_LIKE") == "replicated":
            replicated = jax.tree_util.tree_map(
                lambda x: (
                    jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh(), P()))
                    if isinstance(x, jax.ShapeDtypeStruct)
                    else x
                ),
                skeleton(seed),
            )
            try:
                manager.load(replicated)
            except eqxckpt.StructureMismatchError as e:
                print("REFUSED", json.dumps([path for path, _ in e.mismatched]), str(e).splitlines()[2], flush=True)
                return
        if (rewind := os.environ.get("LOCAL_FROM")) is not None:  # resume from an earlier persistent step
            start = int(rewind)
            checked = check(
                manager.load(skeleton(int(os.environ["LOCAL_FROM_SEED"])), step=start),
                int(os.environ["LOCAL_FROM_SEED"]),
                start,
            )
        elif start is not None:
            checked = check(manager.load(skeleton(seed)), seed, start)
        print(f"RESUMED {start} {checked}", flush=True)
        for step in range(0 if start is None else start + 1, until):
            manager.save(step, make_state(seed, step))
            manager.wait()
            print(f"SAVED {step}", flush=True)


if __name__ == "__main__":
    sys.setrecursionlimit(10_000)
    run_scenarios({"train": train})
