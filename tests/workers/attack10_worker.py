"""One of two JAX processes (one CPU device each) probing the refusal of replicated
leaves whose copies differ between processes. Started by tests/test_attack10_replicas.py.

    python attack10_worker.py SCENARIO PORT NUM_PROCESSES PROCESS_ID DIRECTORY

Prints lines ``RESULT <json>``.
"""

import os
import sys
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attack_worker import result  # noqa: E402


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


SCENARIOS = {f.__name__: f for f in [small_differ]}


def main(scenario: str, port: int, processes: int, process_id: int, directory: str) -> None:
    jax.config.update("jax_num_cpu_devices", 1)
    from distributed_worker import join

    join(port, processes, process_id)
    start = time.monotonic()
    SCENARIOS[scenario](directory)
    result(process=process_id, done=round(time.monotonic() - start, 1))


if __name__ == "__main__":
    from distributed_worker import run_worker

    run_worker(main)
