"""Recovery and save-blocking times of `CheckpointManager`'s local tier (issue #39).

4 JAX processes on 127.0.0.1, one CPU device each; the script starts itself as those
workers. The state is ``--gib`` GiB in all: four float32 matrices sharded by rows over
the 4 devices (a quarter of each per process), a 4 KiB replicated vector and a Python int.

1. **Recovery after one host is lost.** A job saves step 8 to both tiers (persistent +
   local, ``local_replicas=1``) and exits; the benchmark wipes local directories and
   starts a new job that times, in every process, ``latest_step()`` + ``load(like)``
   (``like``: ShapeDtypeStructs with the saved shardings) until its arrays are ready.
   Paths: ``own`` (a restart with every host intact: each process reads its own part),
   ``local`` (host 2's local directory wiped: host 2 fetches its part from the
   peer that kept a copy, the others read their own), ``disk`` (every local directory
   wiped: the persistent tier on this machine's disk) and ``s3`` (the same, with the
   persistent tier on moto's S3 server on 127.0.0.1). Page caches are dropped
   (``sync; echo 3 > /proc/sys/vm/drop_caches``, when run as root) before each restore
   job. Every process compares a CRC-32 of each block it restored with the one the
   saving job computed from the values it saved.
2. **Blocked time of a save.** In a running job, the seconds ``manager.save(step, state)``
   holds the caller's thread for a step saved only to the local tier
   (``local_interval_steps=1``, ``save_interval_steps`` never reached) and for a
   background save to the persistent tier alone (a manager without ``local_path``,
   ``blocking=False``); each step's state has other values; ``manager.wait()`` between
   steps, not timed (its seconds are reported as "until done").

Run from the repository root (as root, for cold page caches):

    PYTHONPATH=. .venv/bin/python benchmarks/local_tier.py --gib 1.0 --repeats 2 --json out.json

Temporary directories only (``--local-root``: where the local tiers go, e.g.
``/dev/shm``; default the temp directory, a disk here).
"""

import argparse
import json
import os
import pathlib
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from typing import Any

PROCESSES = 4
STEP = 8  # saved to both tiers: local_interval_steps=1, save_interval_steps=4
MATRICES = 4
COLUMNS = 1024
BUCKET = "eqxckpt-bench-local"
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
    "TENSORSTORE_S3_USE_CONDITIONAL_WRITE": "1",
}


# -- the workers ------------------------------------------------------------------------


def rows(gib: float) -> int:
    """Rows of each matrix: ``gib`` GiB over `MATRICES` float32 matrices, divisible by 4."""
    per_matrix = int(gib * 2**30) // MATRICES // (4 * COLUMNS)
    return max(PROCESSES, per_matrix - per_matrix % PROCESSES)


def block(name: str, start: int, stop: int, step: int) -> Any:
    """Rows ``start:stop`` of matrix ``name`` at ``step`` (a cheap function of the rows)."""
    import numpy as np

    rng = np.random.default_rng([zlib.crc32(name.encode()), start, step])
    return rng.random((stop - start, COLUMNS), dtype=np.float32)


def make_state(gib: float, step: int) -> dict:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("data",))
    shape = (rows(gib), COLUMNS)

    def matrix(name: str) -> jax.Array:
        def shard(index: Any) -> np.ndarray:  # a tuple of slices
            start, stop, _ = index[0].indices(shape[0])
            return block(name, start, stop, step)

        return jax.make_array_from_callback(shape, NamedSharding(mesh, P("data")), shard)

    replicated = np.arange(1024, dtype=np.float32) * step
    return {
        "params": {f"w{k}": matrix(f"w{k}") for k in range(MATRICES)},
        "norm": jax.make_array_from_callback((1024,), NamedSharding(mesh, P()), lambda i: replicated[i]),
        "step": step,
    }


def checksums(state: dict) -> dict[str, list]:
    """Each array leaf's blocks held here: [[start row, CRC-32 of its bytes], ...]."""
    import jax
    import numpy as np

    out: dict[str, list] = {}
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        path = jax.tree_util.keystr(keypath)
        if isinstance(leaf, jax.Array):
            out[path] = sorted(
                [s.index[0].indices(leaf.shape[0])[0], zlib.crc32(np.asarray(s.data).tobytes())]
                for s in leaf.addressable_shards
            )
        else:
            out[path] = [leaf]
    return out


def pin_gloo_to_loopback() -> None:
    """Gloo binds to what the hostname resolves to; everything here stays on 127.0.0.1."""
    from jax._src.lib import _jax  # pyright: ignore[reportPrivateImportUsage]

    make = _jax.make_gloo_tcp_collectives
    _jax.make_gloo_tcp_collectives = lambda distributed_client, **_: make(distributed_client, hostname="127.0.0.1")


def barrier(name: str) -> None:
    """Every process here before any goes on (the coordination service's barrier)."""
    from jax._src.distributed import global_state

    assert global_state.client is not None
    global_state.client.wait_at_barrier(name, 600_000)


def worker(args: argparse.Namespace) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 1)
    pin_gloo_to_loopback()
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{args.port}",
        coordinator_bind_address=f"127.0.0.1:{args.port}",
        num_processes=PROCESSES,
        process_id=args.process_id,
        initialization_timeout=120,
        heartbeat_timeout_seconds=30,
    )
    import eqxckpt

    me = jax.process_index()
    store = json.loads(args.store) if args.store.startswith("{") else args.store
    local = os.path.join(args.local, f"host{me}")
    result: dict[str, Any] = {"process": me}
    if args.role == "save":
        offered = held_on_device(args.offer_mib)
        state = make_state(args.gib, STEP)
        result["checksums"] = checksums(state)
        with eqxckpt.CheckpointManager(
            store, save_interval_steps=4, local_path=local, local_interval_steps=1, local_replicas=1
        ) as manager:
            barrier("save")
            start = time.perf_counter()
            manager.save(STEP, state)
            manager.wait()
            result["save_s"] = time.perf_counter() - start
        result["offered_peak_bytes"] = offered["peak"]
    elif args.role == "restore":
        want = json.loads(pathlib.Path(args.expect).read_text())[str(me)]
        like = skeleton(args.gib)
        barrier("open")
        start = time.perf_counter()
        manager = eqxckpt.CheckpointManager(
            store, save_interval_steps=4, local_path=local, local_interval_steps=1, local_replicas=1
        )
        result["open_s"] = time.perf_counter() - start
        barrier("restore")
        start = time.perf_counter()
        step = manager.latest_step()
        result["choose_s"] = time.perf_counter() - start
        state = manager.load(like)
        jax.block_until_ready(state)
        result["restore_s"] = time.perf_counter() - start
        manager.close()
        got = checksums(state)
        if step != STEP or got != want:
            raise SystemExit(f"process {me}: restored step {step}, checksums {got} != saved {want}")
        arrays = [x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)]
        result["checked_bytes"] = sum(s.data.nbytes for x in arrays for s in x.addressable_shards)
    else:  # blocked: a local-tier-only manager, then a persistent-only one
        only_local = eqxckpt.CheckpointManager(
            f"{store}-local", save_interval_steps=10**9, local_path=local, local_interval_steps=1, local_replicas=1
        )
        result["local"] = blocked(args, "local", only_local)
        result["persistent"] = blocked(args, "persistent", eqxckpt.CheckpointManager(f"{store}-persistent"))
    print("RESULT " + json.dumps(result), flush=True)
    jax.distributed.shutdown()


def held_on_device(offer_mib: float | None) -> dict[str, int]:
    """The most bytes this process's offers to its peers held on its device at once (what
    a local save adds to device memory), recorded as they are made: ``["peak"]``; with
    ``offer_mib``, the host memory budget its offers are grouped within (default 256 MiB)."""
    from eqxckpt._local import _checkpoints, _peers

    if offer_mib is not None:
        _checkpoints.host_memory_budget = lambda: int(offer_mib * 2**20)

    seen = {"peak": 0}
    offer = _peers.Transfers.offer

    def recorded(self: Any, *args: Any) -> Any:
        out = offer(self, *args)
        held = sum(a.nbytes for arrays in self._offered.values() for a in arrays)
        seen["peak"] = max(seen["peak"], held)
        return out

    _peers.Transfers.offer = recorded
    return seen


def skeleton(gib: float) -> dict:
    """The state's structure, shapes, dtypes and shardings, without its values."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("data",))
    sharded, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    matrix = jax.ShapeDtypeStruct((rows(gib), COLUMNS), np.float32, sharding=sharded)
    return {
        "params": {f"w{k}": matrix for k in range(MATRICES)},
        "norm": jax.ShapeDtypeStruct((1024,), np.float32, sharding=replicated),
        "step": 0,
    }


def blocked(args: argparse.Namespace, name: str, manager: Any) -> dict[str, list[float]]:
    """Seconds ``manager.save`` held this thread, and until ``manager.wait()`` returned,
    for steps 1..``args.steps`` (another state each step)."""
    out: dict[str, list[float]] = {"blocked_s": [], "done_s": []}
    with manager:
        for step in range(1, args.steps + 1):
            state = make_state(args.gib, step)
            barrier(f"blocked-{name}-{step}")
            start = time.perf_counter()
            assert manager.save(step, state)
            out["blocked_s"].append(time.perf_counter() - start)
            manager.wait()
            out["done_s"].append(time.perf_counter() - start)
            del state
    return out


# -- the driver -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def drop_caches() -> bool:
    """Write dirty pages and drop the page cache, so the next reads come from the disk."""
    os.sync()
    try:
        pathlib.Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def load_average() -> str:
    return " ".join(pathlib.Path("/proc/loadavg").read_text().split()[:3])


def launch(role: str, args: argparse.Namespace, work: str, store: str, expect: str = "") -> list[dict]:
    """Run the 4 workers of ``role`` to completion; each one's ``RESULT``, by process."""
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "EQXCKPT_BARRIER_TIMEOUT_S": "600"}
    env.update(CREDENTIALS)
    logs = [pathlib.Path(work) / f"{role}{i}.log" for i in range(PROCESSES)]
    workers = []
    for i, log in enumerate(logs):
        command = [sys.executable, os.path.abspath(__file__), "--worker", role, "--port", str(port)]
        command += ["--process-id", str(i), "--gib", str(args.gib), "--steps", str(args.steps)]
        command += ["--store", store, "--local", args.local_dir, "--expect", expect]
        command += [] if args.offer_mib is None else ["--offer-mib", str(args.offer_mib)]
        with open(log, "wb") as out:
            workers.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env))
    deadline = time.monotonic() + args.timeout
    try:
        while any(w.poll() is None for w in workers):
            if any(w.poll() not in (None, 0) for w in workers) or time.monotonic() > deadline:
                raise SystemExit(f"{role} failed:\n" + "\n".join(log.read_text()[-4000:] for log in logs))
            time.sleep(0.05)
        if any(w.returncode for w in workers):
            raise SystemExit(f"{role} failed:\n" + "\n".join(log.read_text()[-4000:] for log in logs))
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
    results = [json.loads(log.read_text().split("RESULT ", 1)[1].splitlines()[0]) for log in logs]
    return sorted(results, key=lambda r: r["process"])


def wipe(local_dir: str, hosts: list[int]) -> None:
    for host in hosts:
        shutil.rmtree(os.path.join(local_dir, f"host{host}"), ignore_errors=True)


def recovery(args: argparse.Namespace, work: str, store: str, paths: list[str]) -> list[dict]:
    """Save step `STEP` to ``store`` and the local tiers, then restore it once per path
    (``own``: nothing wiped; ``local``: host 2 wiped; ``disk``/``s3``: every host wiped),
    each in a fresh job."""
    saved = launch("save", args, work, store)
    peak = max(r["offered_peak_bytes"] for r in saved) / 2**20
    part = args.gib * 2**30 / PROCESSES / 2**20
    print(f"  save: offers held at most {peak:.1f} MiB on a device at once (a part: {part:.1f} MiB)", flush=True)
    expect = os.path.join(work, "expect.json")
    pathlib.Path(expect).write_text(json.dumps({str(r["process"]): r["checksums"] for r in saved}))
    out = []
    for path in paths:
        wipe(args.local_dir, [] if path == "own" else [2] if path == "local" else list(range(PROCESSES)))
        cold = drop_caches()
        load = load_average()
        restored = launch("restore", args, work, store, expect)
        if path == "local":  # restored from the peer's copy: host 2 keeps its own part again
            assert list(pathlib.Path(args.local_dir).glob(f"host2/eqxckpt-local/*/process-2/own/{STEP}")), path
        seconds = [r["restore_s"] for r in restored]
        out.append(
            {
                "path": path,
                "seconds": seconds,
                "open_s": [r["open_s"] for r in restored],
                "save_s": [r["save_s"] for r in saved],
                "checked_bytes": sum(r["checked_bytes"] for r in restored),
                "cold": cold,
                "loadavg": load,
            }
        )
        print(f"  {path}: max {max(seconds):.2f} s, each {[round(s, 2) for s in seconds]} (load {load})", flush=True)
        print(f"    of which latest_step: {[round(r['choose_s'], 2) for r in restored]}", flush=True)
    return out


def s3_server() -> tuple[Any, str]:
    """moto's S3 server on a free port of 127.0.0.1, with the bucket `BUCKET`."""
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    os.environ.update(CREDENTIALS)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    assert host == "127.0.0.1"
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET)
    return server, endpoint


def s3_spec(endpoint: str, prefix: str) -> str:
    spec = {"driver": "s3", "bucket": BUCKET, "path": prefix, "endpoint": endpoint, "aws_region": "us-east-1"}
    return json.dumps({**spec, "aws_credentials": {"type": "environment"}})


def empty_prefix(endpoint: str, prefix: str) -> None:
    """Delete every object under ``prefix`` (moto keeps them in this process's memory)."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        for at in range(0, len(keys), 1000):
            client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys[at : at + 1000]})


def median(values: list[float]) -> float:
    return statistics.median(values)


def report(results: dict) -> str:
    gb = results["state_bytes"] / 1e9
    lines = [
        f"state {results['state_bytes'] / 2**30:.2f} GiB over {PROCESSES} processes; "
        f"page caches dropped before each restore: {results['cold']}",
        "",
        "| path | max seconds over processes (each run) | GB/s (median) | each process (median) |",
        "|---|---|---|---|",
    ]
    for path in results["paths"]:
        runs = [r for r in results["recovery"] if r["path"] == path]
        maxima = [max(r["seconds"]) for r in runs]
        each = [median([r["seconds"][p] for r in runs]) for p in range(PROCESSES)]
        cells = ", ".join(f"{m:.2f}" for m in maxima)
        lines.append(f"| {path} | {cells} | {gb / median(maxima):.2f} | {', '.join(f'{e:.2f}' for e in each)} |")
    lines += [
        "",
        "| save | blocked seconds (median of steps, max over processes) | until done (same) |",
        "|---|---|---|",
    ]
    for tier in ("local", "persistent"):
        runs = results["blocked"]
        blocked = [max(median(r[tier]["blocked_s"]) for r in run) for run in runs]
        done = [max(median(r[tier]["done_s"]) for r in run) for run in runs]
        lines.append(f"| {tier} | {', '.join(f'{b:.3f}' for b in blocked)} | {', '.join(f'{d:.2f}' for d in done)} |")
    lines += ["", f"load averages: {', '.join(results['loadavgs'])}"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="the state's size, all processes together")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="saves timed per tier in each blocked-time job")
    paths = ["own", "local", "disk", "s3"]
    parser.add_argument("--paths", nargs="+", default=paths, choices=paths)
    parser.add_argument("--local-root", default=None, help="where the local tiers' temp directory goes")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per job")
    parser.add_argument("--json", help="write every measurement here")
    parser.add_argument("--offer-mib", type=float, default=None, help="the budget a local save's offers are grouped in")
    # A worker's arguments (the driver passes them).
    parser.add_argument("--worker", choices=["save", "restore", "blocked"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--local", help=argparse.SUPPRESS)
    parser.add_argument("--expect", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.role = args.worker
        return worker(args)
    results: dict[str, Any] = {"recovery": [], "blocked": [], "paths": args.paths, "loadavgs": [load_average()]}
    results["state_bytes"] = MATRICES * rows(args.gib) * COLUMNS * 4 + 1024 * 4
    results["uptime_before"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(results["uptime_before"], flush=True)
    server, endpoint = s3_server() if "s3" in args.paths else (None, "")
    try:
        for repeat in range(args.repeats):
            with (
                tempfile.TemporaryDirectory(prefix="eqxckpt-lbench-") as work,
                tempfile.TemporaryDirectory(prefix="eqxckpt-lbench-local-", dir=args.local_root) as local_dir,
            ):
                args.local_dir = local_dir
                print(f"repeat {repeat}", flush=True)
                disk = [p for p in args.paths if p != "s3"]
                if disk:
                    results["recovery"] += recovery(args, work, os.path.join(work, "run"), disk)
                if "s3" in args.paths:
                    wipe(local_dir, list(range(PROCESSES)))
                    prefix = f"run-{repeat}-{time.monotonic_ns()}/"
                    try:
                        results["recovery"] += recovery(args, work, s3_spec(endpoint, prefix), ["s3"])
                    finally:
                        empty_prefix(endpoint, prefix)
                wipe(local_dir, list(range(PROCESSES)))
                results["loadavgs"].append(load_average())
                runs = launch("blocked", args, work, os.path.join(work, "blocked"))
                results["blocked"].append(runs)
                for tier in ("local", "persistent"):
                    each = [[round(s, 3) for s in r[tier]["blocked_s"]] for r in runs]
                    print(f"  blocked {tier}: {each}", flush=True)
                results["loadavgs"].append(load_average())
    finally:
        if server is not None:
            server.stop()
    results["cold"] = all(r["cold"] for r in results["recovery"])
    results["uptime_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(results["uptime_after"])
    print(report(results))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
