"""A writer that tests/test_fault_model.py kills, stops or preempts; see there.

    python fault_model_worker.py JSON

JSON names ``run`` and ``step`` (where the run and the step are, as eqxckpt takes them),
``number`` (the step), ``version`` (which values: `tree`), ``mode`` and ``signal_at``.

- ``plain`` / ``overwrite``: ``eqxckpt.save`` of the step (``overwrite=True``);
- ``manager``: a `CheckpointManager` on the run saves the step (incremental: unchanged
  leaves come from its latest step);
- ``train``: a training loop with a manager whose interval saves nothing, from step
  ``number`` on, printing ``step N`` after each step, until a SIGTERM makes it save;
- ``read``: a reader (see `read`), until the file ``stop`` exists;
- ``fork``: a manager saves the step in the background, and the process forks while it
  runs (see `fork`);
- ``stall``: a manager (``preemption_grace_s`` = ``grace``) saves the step, prints
  ``saved``, waits for the file ``go``, saves step ``number + 1`` in the background and
  prints ``saving``; a SIGTERM must end it (the test has stopped the store answering).

With ``signal_at`` = [k, "KILL" | "STOP"], the writer sends itself that signal at its
k-th progress report (k = 0: just before the save starts). It prints ``ready`` just
before it saves, and exits 3 if a save was refused (`CheckpointBusyError`).
"""

import contextlib
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


def matching(got: dict, pick) -> list[int]:
    """The versions whose values ``got`` (some leaves, or slices of them, picked from a
    version's tree by ``pick``) equals, bit for bit (a scalar as the type it was saved as)."""
    found = []
    for version in range(VERSIONS):
        want = pick(tree(version))
        if all(
            type(got[name]) is type(value) and np.asarray(got[name]).tobytes() == np.asarray(value).tobytes()
            if not isinstance(value, np.ndarray)
            else np.asarray(got[name]).dtype == value.dtype and np.asarray(got[name]).tobytes() == value.tobytes()
            for name, value in want.items()
        ):
            found.append(version)
    return found


VERSIONS = 4  # the versions the tests save (`tree`'s argument)


def read(job: dict) -> None:
    """Read the steps ``steps`` ({number: where}) in turn until ``stop`` exists, each whole
    (``eqxckpt.load``) or, with ``lazy``, a few slices of it (`eqxckpt.open`, every other
    read inside `Source.consistent`); at the end print one JSON line for each distinct
    outcome: the step, and the versions its values are (``versions``) or the error
    raised (``error``, ``ours``: whether a `CheckpointError`), and how many reads had it
    (``reads``). Slices are picked by the read's count, not at random."""
    steps = sorted(job["steps"].items(), key=lambda item: int(item[0]))
    like = tree(0)
    count = 0
    outcomes: dict[str, dict] = {}
    print("ready", flush=True)
    while not os.path.exists(job["stop"]):
        time.sleep(0.01)  # the writers' turn too, on a small machine
        for number, where in steps:
            count += 1
            out: dict = {"n": int(number)}
            try:
                if job["lazy"]:
                    ckpt = eqxckpt.open(where)
                    a, b = count % 200, count % 200 + 1 + count % 50
                    f0 = (count * 7919) % 80000
                    small, i = f"{count % 32:02d}", count % 8
                    with ckpt.consistent() if count % 2 else contextlib.nullcontext():
                        got = {
                            "w": ckpt["w"][a:b].get(),
                            "frozen": ckpt["frozen"][f0 : f0 + 1500].get(),
                            "b": ckpt["b"][i].get(),
                            "small": ckpt[f"small/{small}"][1:].get(),
                            "lr": ckpt.leaf("lr").value(),
                        }

                    def pick(t, a=a, b=b, f0=f0, small=small, i=i):
                        return {
                            "w": t["w"][a:b],
                            "frozen": t["frozen"][f0 : f0 + 1500],
                            "b": t["b"][i : i + 1].reshape(()),
                            "small": t["small"][small][1:],
                            "lr": t["lr"],
                        }
                else:
                    loaded = eqxckpt.load(where, like)
                    got = {"w": loaded["w"], "frozen": loaded["frozen"], "b": loaded["b"], "lr": loaded["lr"]}
                    got |= {f"small/{k}": v for k, v in loaded["small"].items()}

                    def pick(t):
                        return {"w": t["w"], "frozen": t["frozen"], "b": t["b"], "lr": t["lr"]} | {
                            f"small/{k}": v for k, v in t["small"].items()
                        }

                out["versions"] = matching(got, pick)
            except Exception as e:  # noqa: BLE001 - reported: the test decides
                out |= {"error": type(e).__name__, "ours": isinstance(e, eqxckpt.CheckpointError)}
                out["message"] = str(e)[:300]
            key = json.dumps({k: v for k, v in out.items() if k != "message"})
            outcomes.setdefault(key, out | {"reads": 0})["reads"] += 1
    for out in outcomes.values():
        print(json.dumps(out), flush=True)


def fork(job: dict) -> None:
    """A manager saves the step in the background; ``delay`` seconds later the process
    forks inside the manager's ``with`` block. The child (a data loader's worker, say)
    then ends as ``child`` says: ``exit`` (``sys.exit(0)``, which leaves the ``with``
    block, closing the manager there; then ``os._exit(0)``: JAX's own shutdown in a
    forked child may crash) or ``sigterm`` (it sleeps until the parent's SIGTERM). The
    parent prints how the child ended and after how long (``child <status> <seconds>``,
    or ``child hung`` past
    ``patience`` seconds), then waits for its save."""
    parent = os.getpid()
    try:
        with eqxckpt.CheckpointManager(job["run"], blocking=False) as manager:
            manager.save(job["number"], tree(job["version"]))
            time.sleep(job["delay"])
            start = time.monotonic()
            pid = os.fork()
            if pid == 0:
                if job["child"] == "exit":
                    sys.exit(0)
                time.sleep(120)
                os._exit(7)
            if job["child"] == "sigterm":
                time.sleep(0.1)
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + job.get("patience", 30)
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    print(f"child {os.waitstatus_to_exitcode(status)} {time.monotonic() - start:.2f}", flush=True)
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    print("child hung", flush=True)
                    break
                time.sleep(0.01)
            manager.wait()
    except SystemExit:
        if os.getpid() != parent:
            os._exit(0)
        raise
    print("committed", flush=True)


def stall(job: dict) -> None:
    manager = eqxckpt.CheckpointManager(job["run"], preemption_grace_s=job["grace"])
    manager.save(job["number"], tree(job["version"]))
    manager.wait()
    print("saved", flush=True)
    while not os.path.exists(job["go"]):
        time.sleep(0.01)
    manager.save(job["number"] + 1, tree(job["next"]))
    print("saving", flush=True)
    for _ in range(3000):  # a trainer's main thread, back in Python between steps
        time.sleep(0.1)
    print("still running", flush=True)


def main(job: dict) -> None:
    count = 0
    signal_at = job.get("signal_at")

    def report(*_: object) -> None:
        nonlocal count
        count += 1
        if signal_at is not None and count == signal_at[0]:
            os.kill(os.getpid(), getattr(signal, "SIG" + signal_at[1]))

    mode = job["mode"]
    if mode in ("read", "fork", "stall"):
        return {"read": read, "fork": fork, "stall": stall}[mode](job)
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
