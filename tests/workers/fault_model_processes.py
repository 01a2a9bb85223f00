"""One of 2–3 JAX processes (one CPU device each) of a job that resumes a run on a local
disk and saves more steps, for tests/test_fault_model.py (which kills one of them at a
random instant, then starts another job with another process count).

    python fault_model_processes.py round PORT NUM_PROCESSES PROCESS_ID DIRECTORY

FM_RUN: the run directory; FM_SAVES: how many steps to save after the last listed one.
The job first loads every step a manager lists (a replicated leaf, restored read once,
and a sharded one) and counts the elements that differ from what that step was saved
with; then saves, replica-parallel (each process writes its share of the replicated
leaf), with retention (3 steps) and incremental reuse (``frozen`` never changes). Prints
``RESULT <json>`` lines: ``listed``, ``checked`` (with ``bad``), ``saving``, ``saved``.
"""

import os
import sys

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attack_worker import global_array, mismatches, result, values  # noqa: E402

SHAPE = (384, 64)  # rows divide by 2 and 3
SPECS = {"r": P(), "s": P("p"), "frozen": P()}


def tag(step: int, name: str) -> str:
    """Which values a leaf of a step holds: ``frozen`` is every step's."""
    return "frozen" if name == "frozen" else f"step{step}/{name}"


def round(directory: str) -> None:  # noqa: A001 - the scenario's name
    import eqxckpt

    me = jax.process_index()
    mesh = Mesh(np.array(jax.devices()), ("p",))
    manager = eqxckpt.CheckpointManager(os.environ["FM_RUN"], blocking=True, max_to_keep=3, save_on_preemption=False)
    steps = manager.all_steps()
    result(process=me, listed=steps)
    like = {k: jax.ShapeDtypeStruct(SHAPE, np.float32, sharding=NamedSharding(mesh, spec)) for k, spec in SPECS.items()}
    for step in steps:
        got = manager.load(like, step=step)
        bad = sum(mismatches(k, got[k], values(tag(step, k), SHAPE, np.float32)) for k in SPECS)
        result(process=me, checked=step, bad=bad)
    first = max(steps, default=-1) + 1
    for step in range(first, first + int(os.environ["FM_SAVES"])):
        result(process=me, saving=step)
        tree = {k: global_array(tag(step, k), SHAPE, np.float32, NamedSharding(mesh, s)) for k, s in SPECS.items()}
        manager.save(step, tree)
        result(process=me, saved=step)
    manager.close()


if __name__ == "__main__":
    from distributed_worker import run_scenarios

    run_scenarios({"round": round})
