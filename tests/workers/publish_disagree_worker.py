"""Processes of one job that ask `save_safetensors` for different things (what an outside
attack found): each scenario's processes must all raise at once, writing nothing and
leaving a model already there as it was. Started by tests/test_safetensors_processes.py.

    python publish_disagree_worker.py SCENARIO PORT NUM_PROCESSES PROCESS_ID DIRECTORY

SCENARIO ``all`` runs every scenario in turn, each in a directory of its name, in one
job: a refused call leaves the processes in step for the next. Each process prints
``OUTCOME {"scenario", "process", "raised"}`` per call it makes.
"""

import json

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import eqxckpt


def tree() -> dict:
    mesh = Mesh(np.array(jax.devices()), ("p",))
    rows = NamedSharding(mesh, P("p"))
    values = {k: np.arange(64, dtype=np.float32).reshape(16, 4) + i for i, k in enumerate("abcd")}
    return {k: jax.make_array_from_callback((16, 4), rows, lambda i, v=v: v[i]) for k, v in values.items()}


def outcome(call) -> None:
    try:
        call()
        raised = None
    except eqxckpt.CheckpointError as e:
        raised = f"{type(e).__name__}: {e}"
    line = {"scenario": _running[0], "process": jax.process_index(), "raised": raised}
    print("OUTCOME " + json.dumps(line), flush=True)


_running = [""]


def first_model(directory: str) -> None:
    """The model every scenario that overwrites starts from."""
    eqxckpt.save_safetensors(f"{directory}/out", tree(), max_shard_size=256)


def metadata_differs(directory: str) -> None:
    me = jax.process_index()
    outcome(lambda: eqxckpt.save_safetensors(f"{directory}/out", tree(), max_shard_size=256, metadata={"k": str(me)}))


def path_differs(directory: str) -> None:
    me = jax.process_index()
    outcome(lambda: eqxckpt.save_safetensors(f"{directory}/out{me}", tree(), max_shard_size=256))


def overwrite_differs(directory: str) -> None:
    first_model(directory)
    overwrite = jax.process_index() == 0
    outcome(lambda: eqxckpt.save_safetensors(f"{directory}/out", tree(), max_shard_size=256, overwrite=overwrite))


def one_bad_argument_then_agreement(directory: str) -> None:
    """One process's metadata is refused: every process's first call raises, and their
    second calls, alike, pair up and write one model."""
    bad = {"k": 1} if jax.process_index() == 1 else {"k": "v"}
    outcome(lambda: eqxckpt.save_safetensors(f"{directory}/out", tree(), max_shard_size=256, metadata=bad))
    outcome(lambda: eqxckpt.save_safetensors(f"{directory}/out2", tree(), max_shard_size=256))


def extra_leaf(directory: str) -> None:
    leaves = tree()
    if jax.process_index() == 1:
        leaves["e"] = leaves["a"]
    outcome(lambda: eqxckpt.save_safetensors(f"{directory}/out", leaves, max_shard_size=256))


def numpy_in_one(directory: str) -> None:
    """A leaf that is a global array in one process and a numpy array in the other."""
    leaves = tree()
    if jax.process_index() == 0:
        leaves["a"] = np.zeros((16, 4), np.float32)
    outcome(lambda: eqxckpt.save_safetensors(f"{directory}/out", leaves, max_shard_size=256))


def bad_name_after_a_model(directory: str) -> None:
    """A name a header cannot hold, found before the old model is uncommitted."""
    first_model(directory)
    outcome(
        lambda: eqxckpt.save_safetensors(
            f"{directory}/out", tree(), max_shard_size=256, overwrite=True, names=lambda p: p + "\ud800"
        )
    )


SCENARIOS = {
    name: function
    for name, function in list(globals().items())
    if callable(function)
    and name not in ("tree", "outcome", "first_model")
    and not name[0].isupper()
    and getattr(function, "__module__", None) == __name__
}


def every_scenario(directory: str) -> None:
    import os

    for name, scenario in sorted(SCENARIOS.items()):
        if name == "all":
            continue
        _running[0] = name
        os.makedirs(f"{directory}/{name}", exist_ok=True)  # every process makes it
        scenario(f"{directory}/{name}")


SCENARIOS["all"] = every_scenario


if __name__ == "__main__":
    from distributed_worker import run_scenarios

    run_scenarios(SCENARIOS)
