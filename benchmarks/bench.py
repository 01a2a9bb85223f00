"""eqxckpt against raw I/O and Orbax at every size: each operation in a fresh process.

Workloads: an Equinox transformer-like model (bf16 embedding, f32 attention,
MLP and norm weights, an int32 buffer) plus its `optax.adam` state with
non-zero moments, at each ``--sizes`` MiB; and states of ``--leaf-counts``
float32 arrays of 1-64 KiB. Peers, same state, same disk, same run:

- raw: every leaf's bytes in one file, plain writes, fsync'd; read back with
  ``readinto`` into numpy buffers (params-only: just those byte ranges);
- floor: raw's file, read as raw reads it, then one ``jax.device_put`` of the
  list of arrays: what any restore into jax arrays costs at least (JAX's own
  per-array cost, which bounds a restore of many small leaves);
- eqxckpt: ``save``; ``load`` into a skeleton of ``jax.ShapeDtypeStruct``
  (what ``eqx.filter_eval_shape`` gives); ``load(at="model")``;
  ``save(blocking=False)``; ``verify``;
- orbax: ``StandardCheckpointer`` (OCDBT, zstd) save, restore, partial
  restore (``PyTreeRestore(partial_restore=True)``) and async save.

Every save is made durable after it returns (every file and directory
fsync'd, timed with it): Orbax does not fsync by itself. Each (peer,
operation) runs ``--repeats`` times, each time in a new Python process that
builds the state, runs a tiny warm-up save and restore with the same peer,
touches and frees memory for the operation (so the VM's page reporting does
not bill one peer), then times only the operation and its peak RSS above the
level before it. Restores run from a warm page cache and from a cold one (as
root: ``drop_caches``; else ``posix_fadvise(DONTNEED)`` on every file).
Start-up is ``import`` plus the first restore of a small state in a fresh
process; S3 runs against moto on 127.0.0.1.

    make bench                                           # everything below
    python benchmarks/bench.py --sizes 64 336 --leaf-counts 10000 --repeats 3
    python benchmarks/bench.py --sizes 336 --leaf-counts --no-s3 --no-startup

Prints the tables and every target with PASS/MISS; ``--json`` writes every
figure (``benchmarks/plot.py`` draws them).
"""

import argparse
import json
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

from workloads import (
    BUCKET,
    _prefault,
    _proc_kib,
    _reset_peak,
    _warm_up,
    build,
    drop,
    files_of,
    op_async,
    op_restore,
    op_s3,
    op_save,
    remove,
    run_json,
    warm,
)

HERE = pathlib.Path(__file__).resolve()


def worker(args) -> dict:
    import jax
    import numpy as np

    warnings.filterwarnings("ignore")
    path = pathlib.Path(args.path)
    skeleton = build(args.workload, abstract=True)
    state_bytes = sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(skeleton))
    reading = args.op in ("restore", "params", "s3-restore")
    if args.op.startswith("s3"):
        op_s3(args.peer, "save", f"warm-up-{os.getpid()}", {"model": {"w": np.ones((4, 4), np.float32)}})
    elif args.op != "verify":
        _warm_up(args.peer, path.parent)
    else:
        import eqxckpt  # noqa: F401  (imported before the clock starts, as every other op's peer is)
    state = None if reading or args.op == "verify" else build(args.workload)
    _prefault(int(1.2 * state_bytes) + (256 << 20))
    before = _reset_peak()
    t0 = time.perf_counter()
    result: dict = {}
    values = None
    if args.op == "save":
        op_save(args.peer, path, state)
    elif args.op == "async":
        result["blocked"], _ = op_async(args.peer, path, state)
    elif args.op == "verify":
        import eqxckpt

        eqxckpt.verify(path)  # the first call in this process, as a user's `eqxckpt verify` is
    elif args.op == "s3-save":
        op_s3(args.peer, "save", args.path, state)
    elif args.op == "s3-restore":
        values = op_s3(args.peer, "restore", args.path, skeleton)
    else:
        values = op_restore(args.peer, path, skeleton, args.op == "params")
    result["seconds"] = time.perf_counter() - t0
    result["peak_delta"] = _proc_kib("VmHWM") * 1024 - before
    result["state_bytes"] = state_bytes
    result["leaves"] = len(jax.tree_util.tree_leaves(skeleton))
    if values is not None:
        result["restored_bytes"] = sum(np.asarray(x).nbytes for x in values)
        # Built only now, so that its memory cannot hide the restore's. A benchmark of wrong answers is worthless.
        expected = build(args.workload)
        expected = jax.tree_util.tree_leaves(expected["model"] if args.op == "params" else expected)
        assert len(values) == len(expected) and all(
            np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(values, expected)
        ), f"{args.peer} restored wrong values"
    return result


# --- the parent: run everything, print the tables ----------------------------------------


def run_worker(args, peer: str, op: str, path, workload: str, env: dict | None = None, cwd: str | None = None) -> dict:
    command = [sys.executable, str(HERE), "--worker", peer, op, str(path), workload]
    return run_json(command, f"{peer} {op} {workload}", env, cwd)


def progress(*parts) -> None:
    print("  " + " ".join(str(p) for p in parts), file=sys.stderr, flush=True)


def measure(
    args, root: pathlib.Path, workload: str, peers: list[str], reads: list[str], extra: list[str], cold: bool
) -> dict:
    """``{peer: {op: [runs]}}``: saves, then reads from a warm (and ``cold``) page cache,
    then ``extra`` (async, verify)."""
    out: dict = {}
    for peer in peers:
        path = root / f"{peer}-{workload.replace(':', '-')}"
        row: dict = out.setdefault(peer, {})
        for i in range(args.repeats):
            remove(path)
            progress(workload, peer, "save", f"{i + 1}/{args.repeats}")
            row.setdefault("save", []).append(run_worker(args, peer, "save", path, workload))
        files = files_of(path)
        row["files"], row["disk_bytes"] = len(files), sum(p.stat().st_size for p in files)
        for op in reads:
            for cache in ("warm", "cold") if cold else ("warm",):
                for i in range(args.repeats):
                    warm(path) if cache == "warm" else drop(path)
                    progress(workload, peer, op, cache, f"{i + 1}/{args.repeats}")
                    row.setdefault(f"{op} {cache}", []).append(run_worker(args, peer, op, path, workload))
        if "verify" in extra and peer.startswith("eqxckpt"):
            for i in range(args.repeats):
                warm(path)
                progress(workload, peer, "verify", f"{i + 1}/{args.repeats}")
                row.setdefault("verify", []).append(run_worker(args, peer, "verify", path, workload))
        remove(path)
        if "async" in extra and peer not in ("raw", "floor"):
            for i in range(args.repeats):
                remove(path)
                progress(workload, peer, "async save", f"{i + 1}/{args.repeats}")
                row.setdefault("async", []).append(run_worker(args, peer, "async", path, workload))
            remove(path)
    return out


STARTUP = """
import time
t0 = time.perf_counter()
import jax, numpy as np
import workloads  # (found through PYTHONPATH)
skeleton = workloads.build({workload!r}, abstract=True)
if {peer!r} == "eqxckpt":
    import eqxckpt
    out = eqxckpt.load({path!r}, skeleton)
else:
    import orbax.checkpoint as ocp
    out = ocp.StandardCheckpointer().restore({path!r}, skeleton)
jax.block_until_ready(out)
print(time.perf_counter() - t0)
"""


def startup(args, root: pathlib.Path) -> dict:
    """Seconds from a fresh interpreter to the first restore done: imports (jax, the
    library), a skeleton, the restore; the same small state for both."""
    workload = f"model:{args.startup_mib}"
    out: dict = {}
    for peer in ("eqxckpt", "orbax"):
        path = root / f"startup-{peer}"
        run_worker(args, peer, "save", path, workload)
        script = STARTUP.format(workload=workload, peer=peer, path=str(path))
        env = dict(os.environ, PYTHONPATH=str(HERE.parent))
        times = []
        for i in range(max(args.repeats, 5)):
            warm(path)
            progress("start-up", peer, f"{i + 1}")
            done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env)
            times.append(float(done.stdout.strip().splitlines()[-1]))
        out[peer] = times
        remove(path)
    return out


def s3(args) -> dict:
    """Save and restore of the ``--s3-mib`` state to moto on 127.0.0.1, eqxckpt and raw.
    Orbax is tried once: its path handling has no s3 driver (it writes s3:// paths as local files)."""
    import boto3
    from moto.server import ThreadedMotoServer

    credentials = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1"}
    os.environ.update(credentials)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET)
        env = {**credentials, "EQXCKPT_BENCH_S3": endpoint, "AWS_ENDPOINT_URL": endpoint}
        workload = f"model:{args.s3_mib}"
        out: dict = {}
        for peer in ("raw", "eqxckpt"):
            for op in ("s3-save", "s3-restore"):
                for i in range(args.repeats):
                    progress("s3", workload, peer, op, f"{i + 1}/{args.repeats}")
                    prefix = f"{peer}-{i if op == 's3-save' else 0}"
                    out.setdefault(peer, {}).setdefault(op, []).append(
                        run_worker(args, peer, op, prefix, workload, env)
                    )
        # Orbax writes an s3:// path as a local directory named "s3:" in its working
        # directory: it runs in a temporary one, removed afterwards.
        scratch = tempfile.mkdtemp(prefix="eqxckpt-bench-orbax-s3-")
        try:
            run_worker(args, "orbax", "s3-save", "orbax", workload, {**env, "EPATH_USE_TF": "false"}, cwd=scratch)
            out["orbax"] = "saved"
            if os.path.exists(os.path.join(scratch, "s3:")):
                out["orbax"] = "saved to a local directory named 's3:', not to S3"
        except RuntimeError as e:
            out["orbax"] = f"failed: {str(e).strip().splitlines()[-1]}"
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return out
    finally:
        server.stop()


# --- the report --------------------------------------------------------------------------


def med(runs: list[dict], field: str = "seconds") -> float:
    return statistics.median(r[field] for r in runs)


def cell(runs: list[dict] | None, field: str = "seconds") -> str:
    if not runs:
        return "—"
    values = [r[field] for r in runs]
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def targets(results: dict) -> list[dict]:
    """Every target of the performance issue, measured: ``{target, value, limit, met}``."""
    rows: list[dict] = []

    def add(name: str, value: float, limit: float, unit: str = "x") -> None:
        rows.append({"target": name, "value": value, "limit": limit, "unit": unit, "met": value <= limit})

    for size, part in results.get("sizes", {}).items():
        e, raw, orbax = part["eqxckpt"], part["raw"], part.get("orbax", {})
        for op, limit in (("save", 1.1), ("restore warm", 1.1), ("restore cold", 1.1), ("params warm", 1.2),
                          ("params cold", 1.2)):  # fmt: skip
            if op not in e:
                continue
            add(f"{size} MiB {op}: eqxckpt / raw", med(e[op]) / med(raw[op]), limit)
            if op != "save" and op in part.get("floor", {}):
                add(f"{size} MiB {op}: eqxckpt / floor", med(e[op]) / med(part["floor"][op]), limit)
            if op in orbax:
                add(f"{size} MiB {op}: eqxckpt / orbax", med(e[op]) / med(orbax[op]), 0.5)
        if "async" in e and "async" in orbax:
            add(
                f"{size} MiB async save, caller blocked: eqxckpt / orbax",
                med(e["async"], "blocked") / med(orbax["async"], "blocked"),
                1.0,
            )
    for count, part in results.get("leaves", {}).items():
        e, raw = part["eqxckpt"], part["raw"]
        limit = 2.0 if int(count) <= 10_000 else 3.0
        add(f"{count} leaves save: eqxckpt / raw", med(e["save"]) / med(raw["save"]), limit)
        add(f"{count} leaves restore: eqxckpt / raw", med(e["restore warm"]) / med(raw["restore warm"]), limit)
        if "floor" in part:
            floor = med(part["floor"]["restore warm"])
            add(f"{count} leaves restore: eqxckpt / floor", med(e["restore warm"]) / floor, limit)
        if "verify" in e:
            add(f"{count} leaves verify / restore", med(e["verify"]) / med(e["restore warm"]), 3.0)
        state = e["save"][0]["state_bytes"]
        # The restore holds the state; save and verify hold nothing new.
        for op, base in (("save", 0.2), ("restore warm", 1.2), ("verify", 0.2)):
            if op in e:
                add(f"{count} leaves {op} peak RSS added (MiB)", med(e[op], "peak_delta") / 2**20,
                    (base * state + (100 << 20)) / 2**20, " MiB")  # fmt: skip
    if "startup" in results:
        s = results["startup"]
        add(
            "start-up (import + first restore): eqxckpt / orbax",
            statistics.median(s["eqxckpt"]) / statistics.median(s["orbax"]),
            1.0,
        )
    return rows


def report(results: dict) -> str:
    lines = [f"machine: {results['machine']}", f"medians of {results['args']['repeats']} (min-max), seconds", ""]
    for title, parts in (("state of", results.get("sizes", {})), ("leaves:", results.get("leaves", {}))):
        for size, part in parts.items():
            e = part["eqxckpt"]["save"][0]
            lines.append(f"{title} {size} ({e['state_bytes'] / 2**20:.0f} MiB in {e['leaves']} leaves)")
            ops = [
                op
                for op in ("save", "restore warm", "restore cold", "params warm", "params cold", "verify")
                if op in part["eqxckpt"]
            ]
            lines.append(f"{'':10}" + "".join(f"{op:>24}" for op in ops) + f"{'files':>8}")
            for peer, row in part.items():
                lines.append(f"{peer:10}" + "".join(f"{cell(row.get(op)):>24}" for op in ops) + f"{row['files']:>8}")
            for peer, row in part.items():
                if "async" in row:
                    lines.append(f"{peer:10} async save: caller blocked {cell(row['async'], 'blocked')} s")
            lines.append("")
    if "startup" in results:
        s = results["startup"]
        lines.append("start-up, import + first restore in a fresh process (s): " + ", ".join(
            f"{peer} {statistics.median(t):.3f} ({min(t):.3f}-{max(t):.3f})" for peer, t in s.items()))  # fmt: skip
    if "s3" in results:
        s = results["s3"]
        lines.append(f"S3 (moto on 127.0.0.1), {results['args']['s3_mib']} MiB state: " + ", ".join(
            f"{peer} {op} {cell(s[peer][op])}" for peer in ("raw", "eqxckpt") for op in ("s3-save", "s3-restore")))  # fmt: skip
        lines.append(f"  orbax to s3://: {s['orbax']}")
    lines += ["", "targets"]
    for row in results["targets"]:
        lines.append(
            f"  {'PASS' if row['met'] else 'MISS'}  {row['target']}: {row['value']:.2f}{row['unit']} (limit {row['limit']:.2f}{row['unit']})"
        )
    return "\n".join(lines)


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{platform.machine()}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, Python {platform.python_version()}, {platform.system()}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="*", default=[64, 336, 792, 3072], help="state sizes, MiB")
    parser.add_argument("--leaf-counts", type=int, nargs="*", default=[10_000, 100_000])
    parser.add_argument("--orbax-max-leaves", type=int, default=10_000, help="skip Orbax above this many leaves")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-cold", dest="cold", action="store_false", help="restore from a warm page cache only")
    parser.add_argument("--no-startup", dest="startup", action="store_false")
    parser.add_argument("--startup-mib", type=float, default=16)
    parser.add_argument("--no-s3", dest="s3", action="store_false")
    parser.add_argument("--s3-mib", type=float, default=336)
    parser.add_argument(
        "--dir",
        default=None,
        help="where to write (default: a new directory in the system's temporary directory; if that is a tmpfs, "
        "point it at the disk to measure)",
    )
    parser.add_argument("--json", default=None, help="also write every figure here")
    parser.add_argument("--worker", nargs=4, metavar=("PEER", "OP", "PATH", "WORKLOAD"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.peer, args.op, args.path, args.workload = args.worker
        print(json.dumps(worker(args)))
        return 0
    root = pathlib.Path(tempfile.mkdtemp(prefix="eqxckpt-bench-", dir=args.dir))  # the system's temporary directory
    results: dict = {"machine": machine(), "args": vars(args), "sizes": {}, "leaves": {}}
    try:
        for size in args.sizes:
            label = f"{size:g}"
            results["sizes"][label] = measure(
                args,
                root,
                f"model:{size:g}",
                ["raw", "floor", "eqxckpt", "orbax"],
                ["restore", "params"],
                ["async"],
                args.cold,
            )
        for count in args.leaf_counts:
            peers = ["raw", "floor", "eqxckpt", "eqxckpt-unpacked"]
            peers += ["orbax"] if count <= args.orbax_max_leaves else []
            results["leaves"][str(count)] = measure(
                args, root, f"leaves:{count}", peers, ["restore"], ["verify"], False
            )
        if args.startup:
            results["startup"] = startup(args, root)
        if args.s3:
            results["s3"] = s3(args)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results["targets"] = targets(results)
    print(report(results))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
