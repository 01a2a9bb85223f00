"""One side of a concurrency test; started (several at once) by tests/test_concurrency.py.

    python concurrency_worker.py ROLE WHERE ARG...

WHERE is a local path or a JSON kvstore spec (S3 on moto). Roles:

- ``train WHERE STEPS KEEP``: a CheckpointManager saving steps 0..STEPS-1
  (KEEP: max_to_keep, 0 for all); prints ``committed N``.
- ``evaluate WHERE STOPFILE``: until STOPFILE exists, open a new manager on the
  run, load its latest step, check it is one step's state, verify it.
- ``overwrite WHERE ROUNDS``: save states 1..ROUNDS to one place, overwriting.
- ``read WHERE STOPFILE``: until STOPFILE exists, load (and lazily read) that place.
- ``rival WHERE STEPS``: a second trainer saving the same steps into the same run.
- ``commit WHERE STEP OVERWRITE``: one save of STEP's state (OVERWRITE 0 or 1);
  its summary says ``committed`` or the error that refused it.
- ``steps WHERE STEPS``: save each step's state to ``WHERE/STEP`` with
  ``overwrite=True`` (racing a manager's retention there).

Every state is a pure function of its step (every array is filled with it, but
``frozen``, the same in every step: a manager's incremental saves take it from the
step before), so a tree mixing two saves is detected. Each role prints one ``summary {json}``
line; a role that fails prints the traceback and exits 1.
"""

import collections
import json
import os
import sys
import time
import traceback

import numpy as np

import eqxckpt

LEAVES = int(os.environ.get("EQXCKPT_TEST_LEAVES", "100"))


FROZEN = np.arange(64 * 1024, dtype=np.float32)


def state(step: int, leaves: int = LEAVES) -> dict:
    return {
        "frozen": FROZEN,
        "layers": [
            {"w": np.full((32, 64), step, np.float32), "b": np.full(64, step, np.int64)} for _ in range(leaves // 2)
        ],
        "step": step,
    }


def where(arg: str):
    return json.loads(arg) if arg.startswith("{") else arg


def one_save(tree: dict) -> int:
    """The step a loaded tree is the state of; raises if it mixes two."""
    step = tree["step"]
    values = {float(np.asarray(leaf).reshape(-1)[0]) for layer in tree["layers"] for leaf in layer.values()}
    bad = [layer for layer in tree["layers"] for leaf in layer.values() if not (np.asarray(leaf) == step).all()]
    if not np.array_equal(tree["frozen"], FROZEN):
        raise AssertionError(f"step {step}: the frozen leaf is not what every step saves")
    if bad or values != {float(step)}:
        raise AssertionError(f"a mix of saves: step {step}, array values {sorted(values)}")
    return step


def stopped(stopfile: str) -> bool:
    return os.path.exists(stopfile)


def train(run, steps: int, keep: int) -> dict:
    with eqxckpt.CheckpointManager(run, max_to_keep=keep or None, blocking=True) as manager:
        for step in range(steps):
            manager.save(step, state(step))
            print(f"committed {step}", flush=True)
    return {"steps": manager.all_steps()}


def evaluate(run, stopfile: str) -> dict:
    counts: collections.Counter = collections.Counter()
    loaded: list[int] = []
    while not stopped(stopfile):
        manager = eqxckpt.CheckpointManager(run)
        step = manager.latest_step()
        if step is None:
            counts["no step yet"] += 1
            time.sleep(0.01)
            continue
        loaded.append(one_save(manager.load(state(0))))
        counts["loads"] += 1
        try:
            report = eqxckpt.verify(manager.path(loaded[-1]))
        except eqxckpt.CheckpointNotFoundError:  # deleted (or being deleted) before verify opened it
            counts["deleted before verify"] += 1
            continue
        if report.ok:
            counts["verified"] += 1
        elif any(
            isinstance(p, str) and ("replaced or deleted" in m or "No checkpoint" in m or "being deleted" in m)
            for p, m in report.problems
        ):
            counts["deleted before verify"] += 1
        else:
            raise AssertionError(f"step {loaded[-1]} does not verify: {report}")
        if loaded[-1] >= 1:  # a plain load of an older path either works or says it is gone
            try:
                one_save(eqxckpt.load(manager.path(loaded[-1] - 1)))
                counts["older loads"] += 1
            except (
                eqxckpt.CheckpointNotFoundError,
                eqxckpt.CheckpointChangedError,
                eqxckpt.IncompleteCheckpointError,
            ) as e:
                counts[f"older: {type(e).__name__}"] += 1
    return {"counts": dict(counts), "first": loaded[:1], "last": loaded[-1:]}


def overwrite(path, rounds: int) -> dict:
    for step in range(1, rounds + 1):
        eqxckpt.save(path, state(step), overwrite=True)
        print(f"committed {step}", flush=True)
    return {"rounds": rounds}


def read(path, stopfile: str) -> dict:
    counts: collections.Counter = collections.Counter()
    steps = set()
    while not stopped(stopfile):
        try:
            steps.add(one_save(eqxckpt.load(path, state(0))))
            counts["loads"] += 1
        except eqxckpt.CheckpointChangedError:
            counts["changed (load)"] += 1
            continue
        try:
            ckpt = eqxckpt.open(path)
            first = ckpt["layers/0/w"].get()
            last = ckpt[f"layers/{LEAVES // 2 - 1}/b"].get()
            if not (first == ckpt["step"]).all() or not (last == ckpt["step"]).all():
                raise AssertionError(f"lazy reads mixed saves: {first.flat[0]}, {last.flat[0]}, step {ckpt['step']}")
            counts["lazy"] += 1
        except eqxckpt.CheckpointChangedError:
            counts["changed (lazy)"] += 1
    return {"counts": dict(counts), "distinct": len(steps)}


def rival(run, steps: int) -> dict:
    counts: collections.Counter = collections.Counter()
    manager = eqxckpt.CheckpointManager(run, max_to_keep=3, blocking=True)
    for step in range(steps):
        try:
            manager.save(step, state(step))
            counts["committed"] += 1
        except (eqxckpt.CheckpointExistsError, eqxckpt.CheckpointBusyError) as e:
            counts[type(e).__name__] += 1  # the other manager saved this step first
    manager.wait()
    return {"counts": dict(counts)}


def commit(path, step: int, overwrite: int) -> dict:
    try:
        eqxckpt.save(path, state(step), overwrite=bool(overwrite))
    except (eqxckpt.CheckpointExistsError, eqxckpt.CheckpointBusyError) as e:
        return {"outcome": type(e).__name__, "message": str(e)}
    return {"outcome": "committed"}


def steps(run, count: int) -> dict:
    counts: collections.Counter = collections.Counter()
    for step in range(count):
        place = {**run, "path": run["path"] + f"{step}/"} if isinstance(run, dict) else os.path.join(run, str(step))
        try:
            eqxckpt.save(place, state(step), overwrite=True)
            counts["committed"] += 1
        except eqxckpt.CheckpointBusyError:
            counts["busy"] += 1  # the manager was saving or deleting that step
    return {"counts": dict(counts)}


ROLES = {
    "train": train,
    "evaluate": evaluate,
    "overwrite": overwrite,
    "read": read,
    "rival": rival,
    "commit": commit,
    "steps": steps,
}

if __name__ == "__main__":
    role, target, *args = sys.argv[1:]
    try:
        parsed = [int(a) if a.isdigit() else a for a in args]
        summary = ROLES[role](where(target), *parsed)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    print("summary " + json.dumps(summary), flush=True)
