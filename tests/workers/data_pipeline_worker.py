"""One process of a training job reading a real Grain pipeline, started by
tests/test_process_state.py.

    python data_pipeline_worker.py train PORT NUM_PROCESSES PROCESS_ID DIRECTORY

Each process reads its own shard of `pipeline` and saves, with every step, the state
of its iterator through the manager (`process_state`); a resumed job restores it. The
state of step s holds s in every element, so the tree and the iterator restored can be
checked to come from the same step. Environment:

- DATA_UNTIL: train up to this step (exclusive).
- DATA_CRASH_AT: every process SIGKILLs itself once it has taken this step's batch
  (saves of earlier steps may still be in flight).
- DATA_LOCAL: ``1`` (default) with a local tier in DIRECTORY/host<i>, saving every
  step; ``0`` without one.

Prints ``RESUMED <step or None> <state's step>``, ``BATCH <step> <values>`` for each
step trained, and ``NEXT <values>``: the batch after the last step trained.
"""

import json
import os
import signal

import grain
import jax
import numpy as np
from distributed_worker import run_scenarios
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import eqxckpt

RECORDS, BATCH, SEED = 4000, 4, 11


def pipeline(process: int, processes: int) -> grain.IterDataset:
    """This process's shard of the job's data: shuffled records, in batches."""
    shard = grain.MapDataset.range(RECORDS).shuffle(seed=SEED)[process::processes]
    return shard.map(lambda x: x * 10 + process).batch(BATCH).to_iter_dataset()


def state_of(step: int) -> dict:
    mesh = Mesh(np.array(jax.devices()), ("data",))
    sharded = NamedSharding(mesh, P("data"))
    shape = (2 * jax.process_count(),)
    return {
        "w": jax.make_array_from_callback(shape, sharded, lambda i: np.full(shape, step, np.int32)[i]),
        "step": step,
    }


def train(directory: str) -> None:
    me, count = jax.process_index(), jax.process_count()
    until = int(os.environ["DATA_UNTIL"])
    crash_at = int(os.environ.get("DATA_CRASH_AT", "-1"))
    local = os.environ.get("DATA_LOCAL", "1") == "1"
    options = {"local_path": f"{directory}/host{me}", "local_interval_steps": 1} if local else {}
    iterator = iter(pipeline(me, count))
    with eqxckpt.CheckpointManager(f"{directory}/run", save_interval_steps=3, **options) as manager:
        resumed = manager.latest_step()
        start = 0
        if resumed is not None:
            like = jax.tree_util.tree_map(
                lambda x: (
                    jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x
                ),
                state_of(0),
            )
            state = manager.load(like, process_state=iterator)
            held = {int(v) for shard in state["w"].addressable_shards for v in np.asarray(shard.data)}
            assert held == {state["step"]}, (held, state["step"])
            print(f"RESUMED {resumed} {state['step']}", flush=True)
            start = resumed + 1
        else:
            print("RESUMED None None", flush=True)
        for step in range(start, until):
            batch = next(iterator)
            if step == crash_at:
                os.kill(os.getpid(), signal.SIGKILL)
            print(f"BATCH {step} {json.dumps(batch.tolist())}", flush=True)
            manager.save(step, state_of(step), process_state=iterator)
    print(f"NEXT {json.dumps(next(iterator).tolist())}", flush=True)


if __name__ == "__main__":
    run_scenarios({"train": train})
