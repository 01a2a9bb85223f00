"""A training run that a test stops with SIGTERM; see tests/test_manager.py.

    python preemption_worker.py DIRECTORY STEPS SAVE_INTERVAL [--big]

Trains like training_worker.py with a CheckpointManager whose interval would not
save the step a SIGTERM arrives at; prints ``step N`` after each step (and waits a
little, so that the signal lands mid-run), and ``done`` at the end. ``--big`` adds
a 64 MiB leaf, so that a signal can land during a save.
"""

import sys
import time

import jax.numpy as jnp
import numpy as np
from training_worker import make_state, train_step

import eqxckpt


def main(directory: str, steps: int, interval: int, big: bool) -> None:
    state = make_state()
    extra = {"big": np.zeros((4096, 4096), np.float32)} if big else {}
    with eqxckpt.CheckpointManager(directory, save_interval_steps=interval, blocking=big) as manager:
        start = manager.latest_step()
        if start is not None:
            state = manager.load({**state, **extra})
            state = {"model": state["model"], "opt_state": state["opt_state"]}
            print(f"resumed from {start}", flush=True)
        for step in range(0 if start is None else start + 1, steps):
            state, _ = train_step(state, jnp.asarray(step))
            manager.save(step, {**state, **extra})
            print(f"step {step}", flush=True)
            time.sleep(0.05)
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), "--big" in sys.argv)
