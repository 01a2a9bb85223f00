"""How fast JAX itself moves each process's payload to a peer process, two ways (issue #39).

N JAX processes (subprocesses of this script, one CPU device each, on 127.0.0.1) each
hold ``--mib`` MiB of float32 in ``--arrays`` arrays and send it to their ring neighbour
(process k to process (k + 1) % N), all at once:

- ``transfer``: `jax.experimental.transfer`, point to point. Each process runs a transfer
  server, publishes its address in the coordination service's key-value store, offers
  its payload with ``await_pull`` and then publishes a "ready" key; its neighbour waits
  for that key and ``pull``s.
- ``collective``: one jitted ``shard_map`` of ``jax.lax.ppermute`` over a 1-D mesh of all
  N devices (gloo on CPU), on global arrays built with
  ``jax.make_array_from_single_device_arrays`` from each process's payload. Its compile
  time is measured apart and excluded from the rounds.

A round is timed from every process leaving a coordination-service barrier to the last
process holding its neighbour's payload on its device (``block_until_ready``); one
untimed first round (connections, gloo set-up) is reported as "first s". Every received
array is compared bit-exact with what its sender holds.

Then, per transport, on the largest N, with a short ``--heartbeat`` timeout and with
``jax_enable_recoverability`` off and on: process 1 SIGKILLs itself a quarter of a
round in, and the survivors report what they see (an error after how long, or nothing
until the coordination service ends them or ``--timeout`` does), then try one more
round with it dead. Process 0 is spared: it hosts the coordination service.

    PYTHONPATH=. /path/to/.venv/bin/python benchmarks/peer_transport.py \\
        [--processes 2 4] [--mib 256] [--arrays 4] [--repeats 3] [--heartbeat 5] [--timeout 90] \\
        [--no-kill] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

TRANSPORTS = ("transfer", "collective")
COLUMNS = 1024  # float32 per row of each array


# --------------------------------------------------------------------------- worker side


def payload(process: int, index: int, rows: int) -> np.ndarray:
    """Array ``index`` of process ``process``: distinct random bits, so that a misplaced or
    stale buffer cannot compare equal."""
    bits = np.random.default_rng([process, index]).integers(0, 2**32, (rows, COLUMNS), dtype=np.uint32)
    return bits.view(np.float32)


def report(tag: str, value: Any) -> None:
    print(f"{tag} {json.dumps(value)}", flush=True)


class Transfer:
    """The ``jax.experimental.transfer`` ring: one server per process, one connection to
    the previous process's server."""

    def __init__(self, jax: Any, client: Any, process: int, processes: int) -> None:
        from jax.experimental import transfer

        self.jax, self.client, self.process, self.processes = jax, client, process, processes
        self.device = jax.local_devices()[0]
        self.server = transfer.start_transfer_server(self.device.client, "127.0.0.1:0", ["127.0.0.1:0"])
        client.key_value_set(f"address/{process}", self.server.address())
        self.source = (process - 1) % processes
        self.ready_timeout_ms = 600_000
        self.connection = self.server.connect(client.blocking_key_value_get(f"address/{self.source}", 60_000))

    def prepare(self, arrays: list[Any]) -> float:
        return 0.0

    def round(self, number: int, arrays: list[Any]) -> list[Any]:
        self.server.await_pull(number * self.processes + self.process, arrays)
        # Only now: a pull of a uuid nobody awaits waits forever.
        self.client.key_value_set(f"ready/{number}/{self.process}", "1")
        self.client.blocking_key_value_get(f"ready/{number}/{self.source}", self.ready_timeout_ms)
        sharding = self.jax.sharding.SingleDeviceSharding(self.device)
        specs = [self.jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in arrays]
        received = self.connection.pull(number * self.processes + self.source, specs)
        return self.jax.block_until_ready(received)


class Collective:
    """The ``ppermute`` ring: one jitted call that every process enters."""

    def __init__(self, jax: Any, client: Any, process: int, processes: int) -> None:
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        self.jax = jax
        self.mesh = Mesh(np.array(jax.devices()), ("p",))
        self.sharding = NamedSharding(self.mesh, PartitionSpec("p"))
        ring = [(k, (k + 1) % processes) for k in range(processes)]

        def shift(*xs: Any) -> tuple[Any, ...]:
            return tuple(jax.lax.ppermute(x, "p", ring) for x in xs)

        spec = PartitionSpec("p")
        self.function = jax.jit(jax.shard_map(shift, mesh=self.mesh, in_specs=spec, out_specs=spec))
        self.processes = processes
        self.compiled: Any = None

    def globals(self, arrays: list[Any]) -> list[Any]:
        return [
            self.jax.make_array_from_single_device_arrays(
                (self.processes * a.shape[0], *a.shape[1:]), self.sharding, [a]
            )
            for a in arrays
        ]

    def prepare(self, arrays: list[Any]) -> float:
        start = time.perf_counter()
        self.compiled = self.function.lower(*self.globals(arrays)).compile()
        return time.perf_counter() - start

    def round(self, number: int, arrays: list[Any]) -> list[Any]:
        out = self.compiled(*self.globals(arrays))
        return [o.addressable_shards[0].data for o in self.jax.block_until_ready(out)]


def check(received: list[Any], source: int, rows: int) -> None:
    for index, array in enumerate(received):
        got = np.asarray(array).view(np.uint32)
        if not np.array_equal(got, payload(source, index, rows).view(np.uint32)):
            raise SystemExit(f"array {index} from process {source} differs from what it sent")


def worker(options: argparse.Namespace) -> None:
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 1)
    jax.config.update("jax_enable_recoverability", options.recoverable)
    process, processes = options.process_id, options.num_processes
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{options.port}",
        coordinator_bind_address=f"127.0.0.1:{options.port}",
        num_processes=processes,
        process_id=process,
        initialization_timeout=60,
        heartbeat_timeout_seconds=options.heartbeat,
    )
    from jax._src.distributed import global_state

    client = global_state.client
    assert client is not None
    report("COLLECTIVES", jax.config.values["jax_cpu_collectives_implementation"])
    rows = options.mib * 2**20 // (4 * COLUMNS * options.arrays)
    device = jax.local_devices()[0]
    arrays = [jax.device_put(payload(process, i, rows), device) for i in range(options.arrays)]
    jax.block_until_ready(arrays)
    ring: Transfer | Collective = (Transfer if options.transport == "transfer" else Collective)(
        jax, client, process, processes
    )
    report("COMPILE", ring.prepare(arrays))
    source = (process - 1) % processes
    rounds = 1 + (options.repeats if options.kill_after is None else 0)
    for number in range(rounds):
        client.wait_at_barrier(f"round/{number}", 120_000)
        start = time.perf_counter()
        received = ring.round(number, arrays)
        report("ROUND", time.perf_counter() - start)
        check(received, source, rows)
        del received
    if options.kill_after is None:
        client.wait_at_barrier("done", 120_000)
        jax.distributed.shutdown()
        return
    # The dead peer: process 1 SIGKILLs itself kill_after seconds into this round.
    client.wait_at_barrier(f"round/{rounds}", 120_000)
    if isinstance(ring, Transfer):  # a dead sender never says "ready": wait a bounded time
        ring.ready_timeout_ms = (2 * options.heartbeat + 3) * 1000
    began = time.perf_counter()
    report("KILL", time.time() + options.kill_after)
    if process == 1:
        threading.Timer(options.kill_after, os.kill, (os.getpid(), signal.SIGKILL)).start()
    for number in (rounds, rounds + 1):  # the second one with the peer already dead
        start = time.perf_counter()
        try:
            received = ring.round(number, arrays)
            check(received, source, rows)
            outcome: dict[str, Any] = {"ok": True}
        except Exception as error:  # noqa: BLE001 - what a survivor sees is the finding
            outcome = {"ok": False, "error": f"{type(error).__name__}: {str(error)[:300]}"}
        now = time.perf_counter()
        report(
            "OUTCOME",
            {"round": number, "seconds": now - start, "after_kill": now - began - options.kill_after, **outcome},
        )
    # Does the coordination service end a survivor once it misses the dead one's heartbeats?
    # Process 0 hosts that service: it stays longest, so that the others' fate is theirs.
    time.sleep(max(0.0, began + options.kill_after + 2 * options.heartbeat + 3 - time.perf_counter()))
    report("ALIVE", time.perf_counter() - began - options.kill_after)
    time.sleep(options.heartbeat + 3 if process == 0 else 0)
    os._exit(0)  # jax.distributed.shutdown would wait for the dead process


# ------------------------------------------------------------------------- launcher side


def launch(
    options: argparse.Namespace, transport: str, processes: int, kill_after: float | None, recoverable: bool = False
) -> list[dict]:
    """Run one set of workers; per process, its reports (and, for a kill run, its exit)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    heartbeat = options.heartbeat if kill_after is not None else 30
    limit = options.timeout if kill_after is not None else 600.0
    with tempfile.TemporaryDirectory() as directory:
        logs = [pathlib.Path(directory) / f"worker{i}.log" for i in range(processes)]
        workers = []
        started = time.time()
        for i, log in enumerate(logs):
            command = [sys.executable, __file__, "--worker", transport, "--port", str(port)]
            command += ["--num-processes", str(processes), "--process-id", str(i), "--mib", str(options.mib)]
            command += ["--arrays", str(options.arrays), "--repeats", str(options.repeats)]
            command += ["--heartbeat", str(heartbeat)]
            if kill_after is not None:
                command += ["--kill-after", str(kill_after)]
            if recoverable:
                command += ["--recoverable"]
            with open(log, "wb") as out:
                workers.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env))
        exits: list[float | None] = [None] * processes
        while any(w.poll() is None for w in workers) and time.time() - started < limit:
            for i, w in enumerate(workers):
                if w.poll() is not None and exits[i] is None:
                    exits[i] = time.time()
            if kill_after is None and any(w.poll() not in (None, 0) for w in workers):
                break
            time.sleep(0.05)
        hung = [w.poll() is None for w in workers]
        exits = [e if e is not None or h else time.time() for e, h in zip(exits, hung)]
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
        texts = [log.read_text() for log in logs]
    if kill_after is None and any(w.returncode != 0 for w in workers):
        raise SystemExit("\n----\n".join(t[-4000:] for t in texts))
    results = []
    for i, text in enumerate(texts):
        result: dict[str, Any] = {"process": i, "returncode": workers[i].returncode, "hung": hung[i]}
        result["exit_time"] = exits[i]
        for line in text.splitlines():
            tag, _, value = line.partition(" ")
            if tag in ("COLLECTIVES", "COMPILE", "ROUND", "OUTCOME", "ALIVE", "KILL"):
                result.setdefault(tag.lower(), []).append(json.loads(value))
        if kill_after is not None and exits[i] is not None and "kill" in result:
            result["exit_after_kill_s"] = exits[i] - result["kill"][0]
        if kill_after is not None:
            fatal = [line for line in text.splitlines() if line.startswith(("F0", "F1", "E0", "E1"))]
            result["fatal"] = fatal[:3]
        results.append(result)
    return results


def measure(options: argparse.Namespace, transport: str, processes: int) -> dict[str, Any]:
    results = launch(options, transport, processes, None)
    rounds = [[r["round"][n] for r in results] for n in range(1 + options.repeats)]
    # A round ends when the last process holds its neighbour's payload.
    times = [max(r) for r in rounds]
    median = statistics.median(times[1:])
    return {
        "transport": transport,
        "processes": processes,
        "mib": options.mib,
        "arrays": options.arrays,
        "collectives": results[0]["collectives"][0],
        "first_s": times[0],
        "round_s": times[1:],
        "median_s": median,
        "gb_per_s_per_process": options.mib * 2**20 / median / 1e9,
        "compile_s": max(r["compile"][0] for r in results),
    }


def dead_peer(
    options: argparse.Namespace, transport: str, processes: int, round_s: float, recoverable: bool
) -> dict[str, Any]:
    kill_after = round_s / 4
    results = launch(options, transport, processes, kill_after, recoverable)
    return {
        "transport": transport,
        "processes": processes,
        "jax_enable_recoverability": recoverable,
        "heartbeat_timeout_s": options.heartbeat,
        "launcher_timeout_s": options.timeout,
        "killed": 1,
        "kill_after_s": kill_after,
        "processes_seen": results,
    }


def print_dead_peer(kill: dict[str, Any], timeout: float) -> None:
    print(
        f"\n{kill['transport']}, N={kill['processes']}, jax_enable_recoverability={kill['jax_enable_recoverability']}:"
        f" process 1 SIGKILLed {kill['kill_after_s']:.3f} s into a round"
        f" (heartbeat timeout {kill['heartbeat_timeout_s']} s)"
    )
    for seen in kill["processes_seen"]:
        if seen["process"] == 1:
            continue
        outcomes = [
            f"round {o['round']}: {'ok' if o['ok'] else o['error']} {o['after_kill']:.2f} s after the kill"
            for o in seen.get("outcome", [])
        ]
        if "alive" in seen:
            outcomes.append(f"still alive {seen['alive'][0]:.1f} s after the kill")
        if seen["hung"]:
            outcomes.append(f"hung: killed by the launcher {timeout:.0f} s after launch")
        elif "exit_after_kill_s" in seen:
            outcomes.append(f"exited rc={seen['returncode']} {seen['exit_after_kill_s']:.1f} s after the kill")
        else:
            outcomes.append(f"exited rc={seen['returncode']} before the kill round")
        print(f"  process {seen['process']}: " + "; ".join(outcomes))
        for line in seen["fatal"]:
            print(f"    {line[:300]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--mib", type=int, default=256, help="payload per process")
    parser.add_argument("--arrays", type=int, default=4, help="arrays the payload is split into")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--transports", nargs="+", choices=TRANSPORTS, default=list(TRANSPORTS))
    parser.add_argument("--heartbeat", type=int, default=5, help="heartbeat timeout (s) of the dead-peer runs")
    parser.add_argument("--timeout", type=float, default=90.0, help="launcher's limit (s) on a dead-peer run")
    parser.add_argument("--no-kill", action="store_true", help="skip the dead-peer runs")
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--worker", choices=TRANSPORTS, dest="transport", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--num-processes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--kill-after", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--recoverable", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.transport is not None:
        return worker(options)

    rows = []
    print("| transport | N | MiB | median s | GB/s per process | compile s | first s |")
    print("|---|---|---|---|---|---|---|")
    for processes in options.processes:
        for transport in options.transports:
            row = measure(options, transport, processes)
            rows.append(row)
            print(
                f"| {transport} | {processes} | {options.mib} | {row['median_s']:.3f} | "
                f"{row['gb_per_s_per_process']:.2f} | {row['compile_s']:.3f} | {row['first_s']:.3f} |",
                flush=True,
            )
    kills = []
    if not options.no_kill:
        processes = max(options.processes)
        for transport in options.transports:
            median = next(r["median_s"] for r in rows if r["transport"] == transport and r["processes"] == processes)
            for recoverable in (False, True):
                kill = dead_peer(options, transport, processes, median, recoverable)
                kills.append(kill)
                print_dead_peer(kill, options.timeout)
    if options.json is not None:
        options.json.write_text(
            json.dumps({"load_average": os.getloadavg(), "rows": rows, "dead_peer": kills}, indent=1)
        )


if __name__ == "__main__":
    main()
