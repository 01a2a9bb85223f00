"""Checkpoints of a state in accelerator memory: eqxckpt against raw I/O and Orbax.

Each operation runs in a fresh process (after a tiny warm-up save and restore
with the same library) on a model + adam state of ``--gib`` GiB built on the
default device (a GPU where there is one):

- async save: seconds the caller is blocked, and until it is committed;
- blocking save, made durable (every file fsync'd, timed with it);
- restore onto the device from a warm page cache into a skeleton of
  ``jax.ShapeDtypeStruct`` with the device's sharding; every value is checked.

raw: ``np.asarray`` of each leaf written to one file and fsync'd; read back
with ``readinto`` and ``jax.device_put``.

    python benchmarks/device_bench.py --gib 4 --repeats 2 --json results-gpu.json
"""

import argparse
import json
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

import workloads  # beside this script

HERE = pathlib.Path(__file__).resolve()


def device_state(gib: float, abstract: bool = False):
    """The benchmark's model + adam state, filled on the default device (deterministic)."""
    import jax

    skeleton = workloads.transformer_state(gib * 1024, abstract=True)
    device = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    leaves, treedef = jax.tree_util.tree_flatten(skeleton)
    if abstract:
        return jax.tree_util.tree_unflatten(
            treedef, [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding) for x in leaves]
        )
    out = []
    for i, x in enumerate(leaves):
        key = jax.random.key(i)
        if jax.numpy.issubdtype(x.dtype, jax.numpy.floating):
            out.append(jax.random.uniform(key, x.shape, jax.numpy.float32, -0.5, 0.5).astype(x.dtype))
        else:
            out.append(jax.random.randint(key, x.shape, 0, 1000, x.dtype))
    return jax.block_until_ready(jax.tree_util.tree_unflatten(treedef, out))


def restore(peer: str, path: pathlib.Path, skeleton):
    import jax

    import eqxckpt

    if peer == "raw":
        leaves, treedef = jax.tree_util.tree_flatten(skeleton)
        host = workloads._raw_restore(path, skeleton)
        return jax.tree_util.tree_unflatten(treedef, [jax.device_put(h, s.sharding) for h, s in zip(host, leaves)])
    if peer == "eqxckpt":
        return eqxckpt.load(path, skeleton)
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer().restore(path, skeleton)


def worker(peer: str, op: str, path: pathlib.Path, gib: float) -> dict:
    import jax

    workloads._warm_up(peer, path.parent)
    skeleton = device_state(gib, abstract=True)
    state = None if op == "restore" else device_state(gib)
    t0 = time.perf_counter()
    result: dict = {}
    if op == "save":
        workloads.op_save(peer, path, state)
    elif op == "async":
        result["blocked"], _ = workloads.op_async(peer, path, state)
    else:
        out = restore(peer, path, skeleton)
        jax.block_until_ready(out)
    result["seconds"] = time.perf_counter() - t0
    if op == "restore":
        expected = device_state(gib)
        got = jax.tree_util.tree_leaves(out)
        assert all(bool((a == b).all()) for a, b in zip(got, jax.tree_util.tree_leaves(expected))), "wrong values"
        result["on"] = str(next(iter(got[0].devices())))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        peer, op, path = args.worker
        print(json.dumps(worker(peer, op, pathlib.Path(path), args.gib)))
        return 0
    import jax

    root = pathlib.Path(tempfile.mkdtemp(prefix="eqxckpt-device-", dir=args.dir))
    results: dict = {"device": str(jax.devices()[0]), "gib": args.gib, "runs": {}}

    def run(peer: str, op: str, path: pathlib.Path) -> dict:
        command = [sys.executable, str(HERE), "--worker", peer, op, str(path), "--gib", str(args.gib)]
        out = workloads.run_json(command, f"{peer} {op}")
        print(f"  {peer} {op}: {out}", file=sys.stderr, flush=True)
        results["runs"].setdefault(f"{peer} {op}", []).append(out)
        return out

    try:
        for peer in ("raw", "eqxckpt", "orbax"):
            path = root / peer
            for _ in range(args.repeats):
                workloads.remove(path)
                run(peer, "save", path)
            for _ in range(args.repeats):
                workloads.warm(path)
                run(peer, "restore", path)
            if peer != "raw":
                for _ in range(args.repeats):
                    workloads.remove(path)
                    run(peer, "async", path)
            workloads.remove(path)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(r["seconds"] for r in v) for k, v in results["runs"].items()}
    blocked = {k: statistics.median(r["blocked"] for r in v) for k, v in results["runs"].items() if "async" in k}
    print(f"device: {results['device']}; state {args.gib} GiB; medians of {args.repeats}, seconds")
    for key, value in med.items():
        print(f"  {key:20} {value:8.3f}" + (f"   caller blocked {blocked[key]:.3f}" if key in blocked else ""))
    results["medians"], results["blocked"] = med, blocked
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
