"""A process that saves checkpoints in a loop until it is killed; see tests/test_crash.py.

    python crash_writer.py DIRECTORY MODE

MODE: sync | async | manager | fresh. Prints ``committed N`` after step N's
checkpoint is committed. Every state is a pure function of its step, so the
test can check any checkpoint it finds bit for bit.
"""

import sys

import numpy as np

import eqxckpt


def state(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {
        "big": np.full((512, 1024), step, np.float32),  # 2 MiB: saves take long enough to be hit
        "frozen": np.full((256, 1024), 7.0, np.float32),  # the same every step: a manager links it
        "layers": [
            {"w": rng.standard_normal((64, 64)).astype(np.float32), "b": np.full(64, step, np.int32)} for _ in range(6)
        ],
        "noise": rng.standard_normal(200_000),
        "step": step,
    }


def main(directory: str, mode: str) -> None:
    if mode == "manager":
        manager = eqxckpt.CheckpointManager(f"{directory}/run", max_to_keep=2)
        for step in range(1, 10**6):
            manager.save(step, state(step))  # returns once step - 1 is committed
            if step > 1:
                print(f"committed {step - 1}", flush=True)
    for step in range(1, 10**6):
        tree = state(step)
        if mode == "sync":
            eqxckpt.save(f"{directory}/ckpt", tree, overwrite=True)
        elif mode == "async":
            handle = eqxckpt.save(f"{directory}/ckpt", tree, overwrite=True, blocking=False)
            tree["big"][:] = -1.0  # the caller reuses its buffers at once
            tree["noise"][:] = np.nan
            handle.wait()
        elif mode == "fresh":
            eqxckpt.save(f"{directory}/ckpt_{step}", tree)
        else:
            raise ValueError(mode)
        print(f"committed {step}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
