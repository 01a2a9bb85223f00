"""Other processes the tests start: JAX worker processes on 127.0.0.1 (`launch`,
`start_workers`), probes with N CPU devices (`on_devices`), the command line
(`run_cli`), and scripts killed at a signal they give (`kill_when`)."""

import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

# The scripts tests start in other processes (and whose helpers some tests import).
WORKERS = pathlib.Path(__file__).parent / "workers"


def kill_when(script: str, ready, timeout: float = 120) -> None:
    """Run ``script`` in a fresh interpreter and SIGKILL it as soon as ``ready()``
    is true: a real writer interrupted at a chosen moment."""
    writer = subprocess.Popen([sys.executable, "-c", script], env=dict(os.environ, JAX_PLATFORMS="cpu"))
    try:
        deadline = time.monotonic() + timeout
        while not ready():
            assert writer.poll() is None and time.monotonic() < deadline, "the writer ended before it could be killed"
            time.sleep(0.005)
        writer.send_signal(signal.SIGKILL)
    finally:
        writer.wait()


def start_workers(
    worker: pathlib.Path, scenario: str, processes: int, directory: pathlib.Path, **env_vars: str
) -> tuple[list[subprocess.Popen], list[pathlib.Path]]:
    """Start ``processes`` JAX worker processes (`tests/workers`: ``WORKER SCENARIO PORT
    NUM_PROCESSES PROCESS_ID DIRECTORY``) on a free port of 127.0.0.1, each writing its
    output to a log in ``directory``: the workers and their logs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", **env_vars}
    logs = [directory / f"{scenario}{i}.log" for i in range(processes)]
    workers = []
    for i, log in enumerate(logs):
        with open(log, "wb") as out:
            command = [sys.executable, str(worker), scenario, str(port), str(processes), str(i), str(directory)]
            workers.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env))
    return workers, logs


class WorkerFailed(AssertionError):
    pass


def launch(
    scenario: str,
    processes: int,
    directory: pathlib.Path,
    timeout: float = 240,
    terminate: tuple[int, str] | None = None,
    worker: pathlib.Path = WORKERS / "distributed_worker.py",
    dies: int | None = None,
    **env_vars: str,
) -> list[str]:
    """Run ``processes`` workers to completion; the first failure kills the rest at once.
    ``terminate=(i, text)``: send worker i SIGTERM once its output holds ``text``.
    ``dies``: a worker killed by a signal on purpose (not a failure)."""
    workers, logs = start_workers(
        worker, scenario, processes, directory, **{"EQXCKPT_BARRIER_TIMEOUT_S": "60", **env_vars}
    )
    deadline = time.monotonic() + timeout
    try:
        while True:
            codes = [w.poll() for w in workers]
            failed = [i for i, code in enumerate(codes) if code not in (None, 0) and not (i == dies and code < 0)]
            if failed or time.monotonic() > deadline:
                reason = (
                    f"worker {failed[0]} exited with {codes[failed[0]]}" if failed else f"timed out after {timeout}s"
                )
                raise WorkerFailed(
                    f"{reason}:\n" + "\n".join(f"--- worker {i}\n{log.read_text()}" for i, log in enumerate(logs))
                )
            if all(code == 0 or (i == dies and code is not None) for i, code in enumerate(codes)):
                return [log.read_text() for log in logs]
            if terminate is not None and terminate[1] in logs[terminate[0]].read_text():
                workers[terminate[0]].send_signal(signal.SIGTERM)
                terminate = None
            time.sleep(0.05)
    finally:
        end_workers(workers)


def end_workers(workers: list[subprocess.Popen]) -> None:
    """Kill the workers still running, and wait for every one."""
    for worker in workers:
        if worker.poll() is None:
            worker.kill()
        worker.wait()


def returns_within(call, seconds: float = 60.0, release=None):
    """``call()``'s outcome (its value, or its exception raised here), failing the test if it
    has not returned within ``seconds`` (a reader blocked on a FIFO, say). ``release()``
    then unblocks it, so that no thread is left hanging."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if release is not None:
            release()
        thread.join(10)
        raise AssertionError(f"still running after {seconds} s: it hangs")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def release_fifo(path) -> None:
    """Open a FIFO for writing and close it, so that a reader blocked on it sees its end."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def run_cli(*args: str, terminal: bool = False) -> tuple[int, str, str]:
    """``eqxckpt ARGS`` in a subprocess: (status, stdout, stderr). ``terminal``: stdout and
    stderr are a pseudo-terminal (120 columns), as in an interactive shell."""
    command = [sys.executable, "-m", "eqxckpt", *args]
    if not terminal:
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        return result.returncode, result.stdout, result.stderr
    import pty

    leader, follower = pty.openpty()
    env = {**os.environ, "COLUMNS": "120", "LINES": "40", "TERM": "xterm-256color"}
    process = subprocess.Popen(command, stdout=follower, stderr=follower, env=env)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal closed: the command is done
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    output = b"".join(chunks).decode()
    return process.wait(timeout=120), output, output


def on_devices(devices: int, args: list[str], timeout: float = 300) -> str:
    """Run ``python *args`` in a fresh process whose JAX has ``devices`` CPU devices (a
    worker script under `WORKERS`, or ``-c`` and code); its stdout, once it succeeded."""
    # The suite's XLA flags kept (its compiler at level 0: these check values, not speed).
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
