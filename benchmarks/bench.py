"""eqxckpt against its peers: time, memory and files, each operation in a fresh process.

Workload: an Equinox transformer-like model (bf16 embedding, f32 attention,
MLP and norm weights, an int32 buffer) plus its `optax.adam` state with
non-zero moments (about 3x the params), ``--mib`` MiB in all; and a many-leaf
state (``--many-leaves`` arrays of 1-64 KiB). Peers, same state, same disk,
same run:

- raw: every leaf's bytes in one file with plain writes and one fsync; read
  back with ``readinto`` into numpy buffers (params-only: just those bytes);
- eqxckpt: durable ``save``; ``load`` into a skeleton of
  ``jax.ShapeDtypeStruct`` (what ``eqx.filter_eval_shape`` gives); ``load(at="model")``; ``save(blocking=False)``;
- orbax default (``StandardCheckpointer``: OCDBT, zstd), orbax uncompressed
  (``PyTreeCheckpointer(use_compression=False)``), orbax partial restore
  (``partial_restore=True``) and orbax async save;
- ``eqx.tree_serialise_leaves`` (it never fsyncs).

Each (peer, operation) runs ``--repeats`` times, every time in a new Python
process that builds the state, then times only the operation and records its
peak RSS above the level before it. Restores read from a warm page cache
(the parent reads the files first). Prints medians with min-max, ratios to raw
and to Orbax, memory, files and bytes on disk, and the issue's targets with
PASS/MISS; ``--json`` writes every figure.

    make bench                                   # 769 MiB, 3 repeats
    python benchmarks/bench.py --mib 256 --repeats 3 --many-leaves 10000
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

HERE = pathlib.Path(__file__).resolve()

# --- the workload (built identically in every worker) -----------------------------------


def transformer_state(mib: float, abstract: bool = False):
    """A model plus adam state, ~``mib`` MiB: arrays, or with ``abstract`` only
    their shapes (so a restore starts from an untouched heap)."""
    import equinox as eqx
    import jax
    import numpy as np
    import optax

    layers = 8
    # Per layer 4 d^2 (attention) + 8 d^2 (MLP) f32 = 48 d^2 bytes; the embedding
    # (8d x d bf16) adds 16 d^2; adam's mu and nu triple the float params.
    d = max(64, round((mib * 2**20 / 3 / (48 * layers + 16)) ** 0.5 / 64) * 64)
    rng = np.random.default_rng(0)

    def fill(shape, dtype=np.float32):
        if abstract:
            return jax.ShapeDtypeStruct(shape, dtype)
        return jax.device_put(rng.standard_normal(shape, dtype=np.float32).astype(dtype))

    class Layer(eqx.Module):
        attn_norm: jax.Array
        q: jax.Array
        k: jax.Array
        v: jax.Array
        o: jax.Array
        mlp_norm: jax.Array
        up: jax.Array
        down: jax.Array

    class Model(eqx.Module):
        embed: jax.Array
        layers: list
        final_norm: jax.Array
        positions: jax.Array  # an int32 buffer, not trained

    def layer():
        return Layer(
            fill((d,)),
            fill((d, d)),
            fill((d, d)),
            fill((d, d)),
            fill((d, d)),
            fill((d,)),
            fill((d, 4 * d)),
            fill((4 * d, d)),
        )

    positions = jax.ShapeDtypeStruct((4096,), np.int32) if abstract else jax.device_put(np.arange(4096, dtype=np.int32))
    model = Model(fill((8 * d, d), jax.numpy.bfloat16), [layer() for _ in range(layers)], fill((d,)), positions)
    params = eqx.filter(model, lambda x: jax.numpy.issubdtype(x.dtype, np.inexact))
    opt_state = jax.eval_shape(optax.adam(1e-3).init, params)
    # Non-zero moments, as after some steps (and so nothing compresses for free).
    opt_state = jax.tree_util.tree_map(
        lambda x: (
            fill(x.shape, x.dtype)
            if jax.numpy.issubdtype(x.dtype, np.inexact)
            else (x if abstract else jax.device_put(np.zeros(x.shape, x.dtype)))
        ),
        opt_state,
    )
    return {"model": model, "opt_state": opt_state}


def many_leaf_state(count: int, abstract: bool = False):
    """``count`` f32 arrays of 1-64 KiB, nested as blocks of norms and biases."""
    import jax
    import numpy as np

    rng = np.random.default_rng(1)
    sizes = rng.integers(256, 16 * 1024, size=count)  # 1-64 KiB of float32

    def fill(size):
        if abstract:
            return jax.ShapeDtypeStruct((size,), np.float32)
        return jax.device_put(rng.standard_normal(size, dtype=np.float32))

    per_block = 100
    return {
        f"block_{b}": {
            f"p{i}": fill(int(sizes[b * per_block + i])) for i in range(min(per_block, count - b * per_block))
        }
        for b in range((count + per_block - 1) // per_block)
    }


# --- the peers' operations ---------------------------------------------------------------


def _raw_save(path, state):
    import jax
    import numpy as np

    with open(path, "wb", buffering=0) as f:
        for leaf in jax.tree_util.tree_leaves(state):
            f.write(np.ascontiguousarray(leaf).reshape(-1).view(np.uint8))
        os.fsync(f.fileno())
    fd = os.open(os.path.dirname(path), os.O_RDONLY)
    os.fsync(fd)  # make the new name durable too
    os.close(fd)


def _raw_restore(path, skeleton, wanted=None):
    """readinto numpy buffers; with ``wanted`` (leaf indices) only those byte ranges."""
    import jax
    import numpy as np

    leaves, treedef = jax.tree_util.tree_flatten(skeleton)
    out = [None] * len(leaves)
    offset = 0
    with open(path, "rb", buffering=0) as f:
        for i, s in enumerate(leaves):
            size = int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
            if wanted is None or i in wanted:
                buf = np.empty(s.shape, s.dtype)
                f.seek(offset)
                f.readinto(memoryview(buf.reshape(-1).view(np.uint8)))
                out[i] = buf
            offset += size
    return out


def _orbax_standard():
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer()


def _orbax_uncompressed():
    import orbax.checkpoint as ocp

    return ocp.PyTreeCheckpointer(use_compression=False)


def _restore_args(skeleton):
    import orbax.checkpoint as ocp

    return ocp.checkpoint_utils.construct_restore_args(skeleton)


def op_save(peer, path, state):
    import equinox as eqx

    import eqxckpt

    if peer == "raw":
        _raw_save(path, state)
    elif peer == "eqxckpt":
        eqxckpt.save(path, state)
    elif peer == "orbax":
        ckptr = _orbax_standard()
        ckptr.save(path, state)
        ckptr.wait_until_finished()
    elif peer == "orbax-uncompressed":
        import orbax.checkpoint as ocp

        _orbax_uncompressed().save(path, args=ocp.args.PyTreeSave(state))
    elif peer == "serialise":
        eqx.tree_serialise_leaves(path, state)


def op_restore(peer, path, skeleton, params_only):
    import equinox as eqx
    import jax

    import eqxckpt

    target = {"model": skeleton["model"]} if params_only else skeleton
    if peer == "raw":
        wanted = set(range(len(jax.tree_util.tree_leaves(skeleton["model"])))) if params_only else None
        return [x for x in _raw_restore(path, skeleton, wanted) if x is not None]
    if peer == "eqxckpt":
        out = eqxckpt.load(path, skeleton["model"], at="model") if params_only else eqxckpt.load(path, skeleton)
    elif peer == "orbax":
        if params_only:
            import orbax.checkpoint as ocp

            out = ocp.PyTreeCheckpointer().restore(
                path, args=ocp.args.PyTreeRestore(item=target, restore_args=_restore_args(target), partial_restore=True)
            )
        else:
            out = _orbax_standard().restore(path, skeleton)
    elif peer == "orbax-uncompressed":
        import orbax.checkpoint as ocp

        out = _orbax_uncompressed().restore(
            path, args=ocp.args.PyTreeRestore(item=target, restore_args=_restore_args(target))
        )
    elif peer == "serialise":
        out = eqx.tree_deserialise_leaves(path, skeleton)
    return jax.block_until_ready(jax.tree_util.tree_leaves(out))


def op_async(peer, path, state):
    """Seconds the caller is blocked, then seconds until committed."""
    import eqxckpt

    if peer == "eqxckpt":
        t0 = time.perf_counter()
        handle = eqxckpt.save(path, state, blocking=False)
        blocked = time.perf_counter() - t0
        handle.wait()
    else:
        ckptr = _orbax_standard()  # built before timing, as a training loop would
        t0 = time.perf_counter()
        ckptr.save(path, state)
        blocked = time.perf_counter() - t0
        ckptr.wait_until_finished()
    return blocked, time.perf_counter() - t0


# --- one operation in this (fresh) process ---------------------------------------------


def _proc_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def _reset_peak() -> int:
    """Reset the peak-RSS counter (Linux) and return the current RSS in bytes."""
    import gc

    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _proc_kib("VmRSS") * 1024


def worker(args) -> dict:
    import jax
    import numpy as np

    warnings.filterwarnings("ignore")
    build = (
        (lambda abstract: many_leaf_state(args.many_leaves, abstract))
        if args.workload == "many"
        else (lambda abstract: transformer_state(args.mib, abstract))
    )

    def nbytes(tree):
        return sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(tree))

    if args.op in ("restore", "params"):
        skeleton = build(abstract=True)
        before = _reset_peak()
        t0 = time.perf_counter()
        values = op_restore(args.peer, args.path, skeleton, args.op == "params")
        result = {
            "seconds": time.perf_counter() - t0,
            "peak_delta": _proc_kib("VmHWM") * 1024 - before,
            "restored_bytes": nbytes(values),
        }
        # Built only now, so that its freed memory cannot hide the restore's.
        state = build(abstract=False)
        expected = jax.tree_util.tree_leaves(state["model"] if args.op == "params" else state)
        # A benchmark of wrong answers is worthless.
        assert len(values) == len(expected) and all(
            np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(values, expected)
        ), f"{args.peer} restored wrong values"
    else:
        state = build(abstract=False)
        before = _reset_peak()
        result = {}
        if args.op == "save":
            t0 = time.perf_counter()
            op_save(args.peer, args.path, state)
            result["seconds"] = time.perf_counter() - t0
        else:
            result["blocked"], result["seconds"] = op_async(args.peer, args.path, state)
        result["peak_delta"] = _proc_kib("VmHWM") * 1024 - before
    result.update(state_bytes=nbytes(state), leaves=len(jax.tree_util.tree_leaves(state)))
    return result


# --- the parent: run everything, print the tables ----------------------------------------


def run_worker(args, peer, op, path, workload) -> dict:
    cmd = [
        sys.executable,
        str(HERE),
        "--worker",
        peer,
        op,
        str(path),
        "--workload",
        workload,
        "--mib",
        str(args.mib),
        "--many-leaves",
        str(args.many_leaves),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{peer} {op} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def disk_usage(path: pathlib.Path) -> tuple[int, int]:
    if path.is_file():
        return 1, path.stat().st_size
    files = [p for p in path.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def warm(path: pathlib.Path) -> None:
    for p in [path] if path.is_file() else path.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(1 << 24):
                    pass


def remove(path: pathlib.Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


SAVE_PEERS = ["raw", "eqxckpt", "orbax", "orbax-uncompressed", "serialise"]


def measure(args, root: pathlib.Path, workload: str, peers: list[str], params: list[str], asyncs: list[str]) -> dict:
    out: dict = {}
    for peer in peers:
        path = root / (f"{workload}-{peer}" + (".eqx" if peer == "serialise" else ""))
        row = out[peer] = {"save": [], "restore": [], "params": []}
        for i in range(args.repeats):
            remove(path)
            print(f"  {workload}: {peer} save {i + 1}/{args.repeats}", file=sys.stderr, flush=True)
            row["save"].append(run_worker(args, peer, "save", path, workload))
        row["files"], row["disk_bytes"] = disk_usage(path)
        ops = ["restore"] + (["params"] if peer in params else [])
        for op in ops:
            for i in range(args.repeats):
                warm(path)
                print(f"  {workload}: {peer} {op} {i + 1}/{args.repeats}", file=sys.stderr, flush=True)
                row[op].append(run_worker(args, peer, op, path, workload))
        remove(path)
    for peer in asyncs:
        key = f"{peer} async"
        out[key] = {"async": []}
        for i in range(args.repeats):
            path = root / f"{workload}-{peer}-async"
            remove(path)
            print(f"  {workload}: {peer} async save {i + 1}/{args.repeats}", file=sys.stderr, flush=True)
            out[key]["async"].append(run_worker(args, peer, "async", path, workload))
            remove(path)
    return out


def med(runs: list[dict], field: str = "seconds") -> float:
    return statistics.median(r[field] for r in runs)


def cell(runs: list[dict], field: str = "seconds") -> str:
    if not runs:
        return "—"
    values = [r[field] for r in runs]
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def ratio(a: float, b: float | None) -> str:
    return "—" if not b else f"{a / b:.2f}x"


def report(results: dict, args) -> tuple[str, list[tuple[str, bool, str]]]:
    t = results["transformer"]
    state_mib = t["eqxckpt"]["save"][0]["state_bytes"] / 2**20
    leaves = t["eqxckpt"]["save"][0]["leaves"]
    lines = [
        f"machine: {results['machine']}",
        f"workload: model + adam state, {state_mib:.0f} MiB in {leaves} leaves; medians of {args.repeats} "
        "(min-max) seconds; each operation in a fresh process; restores from a warm page cache",
        "",
        f"{'':20} {'save (durable)':>24} {'restore':>24} {'params-only restore':>24} {'files':>6} {'MiB on disk':>11}",
    ]
    names = {
        "raw": "raw",
        "eqxckpt": "eqxckpt",
        "orbax": "orbax default",
        "orbax-uncompressed": "orbax uncompressed",
        "serialise": "tree_serialise_leaves",
    }
    for peer in SAVE_PEERS:
        row = t[peer]
        lines.append(
            f"{names[peer]:20} {cell(row['save']):>24} {cell(row['restore']):>24} {cell(row['params']):>24} "
            f"{row['files']:>6} {row['disk_bytes'] / 2**20:>11.0f}"
        )
    lines += ["", f"{'ratios':20} {'save':>24} {'restore':>24} {'params-only restore':>24}"]
    for peer in SAVE_PEERS[1:]:
        row = t[peer]
        cells = []
        for op in ("save", "restore", "params"):
            if not row[op]:
                cells.append("—")
                continue
            m = med(row[op])
            cells.append(f"{ratio(m, med(t['raw'][op]))} raw, {ratio(m, med(t['orbax'][op]))} orbax")
        lines.append(f"{names[peer]:20} {cells[0]:>24} {cells[1]:>24} {cells[2]:>24}")
    lines += [
        "",
        "peak RSS above the level before the operation (MiB; x = of the bytes saved or restored)",
        f"{'':20} {'save':>16} {'restore':>16} {'params-only':>16}",
    ]
    for peer in SAVE_PEERS:
        row = t[peer]
        cells = []
        for op, size in (("save", "state_bytes"), ("restore", "restored_bytes"), ("params", "restored_bytes")):
            if not row[op]:
                cells.append("—")
                continue
            peak = med(row[op], "peak_delta")
            cells.append(f"{peak / 2**20:.0f} ({peak / med(row[op], size):.2f}x)")
        lines.append(f"{names[peer]:20} {cells[0]:>16} {cells[1]:>16} {cells[2]:>16}")
    lines += ["", f"{'async save':20} {'caller blocked s':>24} {'until committed s':>24} {'peak RSS MiB':>14}"]
    for key in ("eqxckpt async", "orbax async"):
        runs = t[key]["async"]
        lines.append(f"{key:20} {cell(runs, 'blocked'):>24} {cell(runs):>24} {med(runs, 'peak_delta') / 2**20:>14.0f}")

    checks: list[tuple[str, bool, str]] = []

    def check(name: str, ok: bool, detail: str) -> None:
        checks.append((name, ok, detail))

    e, raw, orbax = t["eqxckpt"], t["raw"], t["orbax"]
    s = med(e["save"])
    check(
        "durable save <= 1.2x raw and <= 0.5x orbax",
        s <= 1.2 * med(raw["save"]) and s <= 0.5 * med(orbax["save"]),
        f"{ratio(s, med(raw['save']))} raw, {ratio(s, med(orbax['save']))} orbax",
    )
    r = med(e["restore"])
    check(
        "restore <= 1.2x raw and <= 0.4x orbax",
        r <= 1.2 * med(raw["restore"]) and r <= 0.4 * med(orbax["restore"]),
        f"{ratio(r, med(raw['restore']))} raw, {ratio(r, med(orbax['restore']))} orbax",
    )
    p = med(e["params"])
    check(
        "params-only restore <= 1.3x raw and <= 1/3 orbax",
        p <= 1.3 * med(raw["params"]) and p <= med(orbax["params"]) / 3,
        f"{ratio(p, med(raw['params']))} raw, {ratio(p, med(orbax['params']))} orbax",
    )
    b, ob = med(t["eqxckpt async"]["async"], "blocked"), med(t["orbax async"]["async"], "blocked")
    check("async block <= 1.5x orbax", b <= 1.5 * ob, f"{b:.3f} s vs {ob:.3f} s ({ratio(b, ob)})")
    state_bytes = e["save"][0]["state_bytes"]
    m = med(e["save"], "peak_delta") / state_bytes
    check("blocking save adds <= 10% of the state", m <= 0.10, f"{m:.1%}")
    m = med(e["restore"], "peak_delta") / med(e["restore"], "restored_bytes")
    check("restore peaks <= 1.15x restored bytes", m <= 1.15, f"{m:.2f}x")
    m = med(t["eqxckpt async"]["async"], "peak_delta") / state_bytes
    check("async save <= one extra copy", m <= 1.0 + 0.10, f"{m:.2f}x the state")

    many = results.get("many")
    if many:
        n = many["eqxckpt"]["save"][0]["leaves"]
        lines += [
            "",
            f"many small leaves: {n} arrays of 1-64 KiB, {many['eqxckpt']['save'][0]['state_bytes'] / 2**20:.0f} MiB",
            f"{'':20} {'save':>24} {'restore':>24} {'files':>6}",
        ]
        for peer in many:
            row = many[peer]
            lines.append(f"{names[peer]:20} {cell(row['save']):>24} {cell(row['restore']):>24} {row['files']:>6}")
        for op in ("save", "restore"):
            a, o = med(many["eqxckpt"][op]), med(many["orbax"][op])
            check(f"{n} leaves: {op} no slower than orbax", a <= o, f"{a:.3f} s vs {o:.3f} s ({ratio(a, o)})")
    imp = results.get("import")
    if imp:
        check(
            "import eqxckpt no slower than orbax.checkpoint",
            imp["eqxckpt"] <= imp["orbax.checkpoint"],
            f"{imp['eqxckpt']:.2f} s vs {imp['orbax.checkpoint']:.2f} s",
        )
    lines += ["", "targets"] + [f"  {'PASS' if ok else 'MISS'}  {name}: {detail}" for name, ok, detail in checks]
    return "\n".join(lines), checks


def import_time(module: str) -> float:
    """Median wall time of ``python -c 'import module'`` in fresh processes."""
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", f"import {module}"], check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{platform.machine()}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, Python {platform.python_version()}, {platform.system()}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, default=769, help="size of the model + adam state")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--many-leaves", type=int, default=10_000, help="leaves in the many-leaf state (0: skip)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir under the current one)")
    parser.add_argument("--json", default=None, help="also write every figure here")
    parser.add_argument("--worker", nargs=3, metavar=("PEER", "OP", "PATH"), help=argparse.SUPPRESS)
    parser.add_argument("--workload", default="transformer", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.peer, args.op, args.path = args.worker
        print(json.dumps(worker(args)))
        return 0
    root = pathlib.Path(tempfile.mkdtemp(prefix="eqxckpt-bench-", dir=args.dir or os.getcwd()))
    results: dict = {"machine": machine(), "args": vars(args)}
    try:
        results["transformer"] = measure(
            args, root, "transformer", SAVE_PEERS, ["raw", "eqxckpt", "orbax"], ["eqxckpt", "orbax"]
        )
        if args.many_leaves:
            results["many"] = measure(args, root, "many", ["raw", "eqxckpt", "orbax"], [], [])
        results["import"] = {m: import_time(m) for m in ("eqxckpt", "orbax.checkpoint")}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text, checks = report(results, args)
    print(text)
    results["targets"] = [{"target": n, "met": ok, "detail": d} for n, ok, d in checks]
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
