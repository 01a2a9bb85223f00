"""A writer that tests/test_fault_model.py kills, stops or preempts; see there.

    python fault_model_worker.py JSON

JSON names ``run`` and ``step`` (where the run and the step are, as eqxckpt takes them),
``number`` (the step), ``version`` (which values: `tree`), ``mode`` and ``signal_at``.

- ``plain`` / ``overwrite``: ``eqxckpt.save`` of the step (``overwrite=True``);
- ``manager``: a `CheckpointManager` on the run saves the step (incremental: unchanged
  leaves come from its latest step);
- ``train``: a training loop with a manager whose interval saves nothing, from step
  ``number`` on, printing ``step N`` after each step, until a SIGTERM makes it save.

With ``signal_at`` = [k, "KILL" | "STOP"], the writer sends itself that signal at its
k-th progress report (k = 0: just before the save starts). It prints ``ready`` just
before it saves, and exits 3 if a save was refused (`CheckpointBusyError`).
"""

import json
import os
import signal
import sys
import time

import numpy as np

import eqxckpt


def tree(version: int) -> dict:
    """The values saved as ``version``: ``frozen`` never changes (so a manager's steps
    share it; too large to be packed), ``b`` changes every second version, ``w`` and the
    scalar ``lr`` (a manifest value, covered by its CRC-32C) every version; ``w``, ``b``
    and the 32 ``small`` leaves are packed into one array, shared whole by a step that
    saves the version its base saved."""
    rng = np.random.default_rng(version)
    return {
        "frozen": np.arange(80 * 1024, dtype=np.float32) * 0.5,
        "w": rng.standard_normal(256).astype(np.float32),
        "b": np.full(8, version // 2, np.int32),
        "lr": 0.1 * version,
        "small": {f"{i:02d}": np.full(4, i + version // 2, np.int16) for i in range(32)},
    }


def train_version(step: int) -> int:
    """The version a training loop saves at ``step``."""
    return step % 4


def main(job: dict) -> None:
    count = 0
    signal_at = job.get("signal_at")

    def report(*_: object) -> None:
        nonlocal count
        count += 1
        if signal_at is not None and count == signal_at[0]:
            os.kill(os.getpid(), getattr(signal, "SIG" + signal_at[1]))

    mode = job["mode"]
    if mode == "train":
        with eqxckpt.CheckpointManager(job["run"], save_interval_steps=10**6) as manager:
            for step in range(job["number"], job["number"] + 10**4):
                manager.save(step, tree(train_version(step)))
                print(f"step {step}", flush=True)
                time.sleep(0.05)
        return
    values = tree(job["version"])
    print("ready", flush=True)
    if signal_at is not None and signal_at[0] == 0:
        os.kill(os.getpid(), getattr(signal, "SIG" + signal_at[1]))
    try:
        if mode == "manager":
            with eqxckpt.CheckpointManager(job["run"], blocking=True) as manager:
                manager.save(job["number"], values, progress=report)
        else:
            eqxckpt.save(job["step"], values, overwrite=mode == "overwrite", progress=report)
    except eqxckpt.CheckpointBusyError as e:
        print("refused:", e, flush=True)
        sys.exit(3)
    print("committed", flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
