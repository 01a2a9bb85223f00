"""Host memory and time of a restore, onto one device or several, at several host-memory budgets.

    python benchmarks/host_budget.py --gib 2 --devices 8 --budgets 64 256 4096 --repeats 3 [--spec columns]
    python benchmarks/host_budget.py --gib 2 --leaves 1 --devices 4 --budgets 256 --spec one [--cast bfloat16]
    python benchmarks/host_budget.py --gib 2 --leaves 1 --budgets 256 --spec one --format safetensors

Saves a float32 state of ``--gib`` GiB (``--leaves`` leaves, 16 by default) once, then
restores it in a fresh process per run onto ``--devices`` devices (CPU devices made by
``--xla_force_host_platform_device_count`` unless a GPU is present), split by
``--spec``: rows (``P("x", None)``, the default), columns (``P(None, "x")``),
replicated (``P()``: every device holds the whole leaf) or one (the first device
alone), with ``load(..., host_memory_budget=...)`` (0: the argument is not passed, so
eqxckpt versions without it can be measured the same way, with ``PYTHONPATH``
pointing at their checkout). ``--cast`` restores into another dtype (``cast=True``);
``--format safetensors`` saves a safetensors file instead. Reports the peak RSS above
the RSS before the load (``VmHWM``, reset first), minus the restored bytes that live
in host memory (on CPU devices the result itself: a replicated leaf's devices share
one host buffer, so it counts once), and the time.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

SPECS = {"rows": ("x", None), "columns": (None, "x"), "replicated": (), "one": None}


def rows_of(gib: float, leaves: int) -> int:
    return int(gib * 2**30 / leaves / 4 / 4096) // 8 * 8


def worker(path: str, gib: float, budget_mib: int, spec: str, leaves: int, cast: str) -> None:
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np

    import eqxckpt

    rows = rows_of(gib, leaves)
    devices = jax.devices()
    if SPECS[spec] is None:
        sharding = jax.sharding.SingleDeviceSharding(devices[0])
    else:
        mesh = jax.sharding.Mesh(np.array(devices), ("x",))
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*SPECS[spec]))
    dtype = jnp.dtype(cast or "float32")
    like = {f"w{i}": jax.ShapeDtypeStruct((rows, 4096), dtype, sharding=sharding) for i in range(leaves)}

    def kib(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = kib("VmRSS")
    started = time.perf_counter()
    budget: dict = {} if budget_mib == 0 else {"host_memory_budget": budget_mib << 20}  # 0: load's default
    out = jax.block_until_ready(eqxckpt.load(path, like, cast=bool(cast), **budget))
    seconds = time.perf_counter() - started
    peak = (kib("VmHWM") - before) * 1024
    on_host = all(d.platform == "cpu" for d in devices)
    restored = 0
    for i in range(leaves):
        shards = out[f"w{i}"].addressable_shards
        assert all((np.asarray(s.data) == i).all() for s in shards)
        # Distinct host buffers: a replicated leaf's CPU devices may share one.
        restored += sum({s.data.unsafe_buffer_pointer(): s.data.nbytes for s in shards}.values())
    extra = peak - (restored if on_host else 0)
    print(json.dumps({"seconds": seconds, "extra_mib": extra / 2**20, "restored_mib": restored / 2**20}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--leaves", type=int, default=16)
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 256, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--spec", choices=sorted(SPECS), default="rows")
    parser.add_argument("--cast", default="", help="restore into this dtype (cast=True)")
    parser.add_argument("--format", choices=["eqxckpt", "safetensors"], default="eqxckpt")
    parser.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        path, gib, budget, spec, leaves, cast = args.worker
        worker(path, float(gib), int(budget), spec, int(leaves), cast if cast != "-" else "")
        return
    env = dict(os.environ, MALLOC_TRIM_THRESHOLD_=str(128 * 1024))
    env.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.devices}")
    with tempfile.TemporaryDirectory(prefix="eqxckpt-host-budget-") as root:
        import numpy as np

        import eqxckpt

        rows = rows_of(args.gib, args.leaves)
        state = {f"w{i}": np.full((rows, 4096), i, np.float32) for i in range(args.leaves)}
        if args.format == "safetensors":
            path = os.path.join(root, "ckpt.safetensors")
            eqxckpt.save_safetensors(path, state)
        else:
            path = os.path.join(root, "ckpt")
            eqxckpt.save(path, state)
        del state
        print(
            f"{args.gib} GiB in {args.leaves} leaves ({args.format}) onto {args.devices} devices by {args.spec}"
            f"{', cast to ' + args.cast if args.cast else ''}; median of {args.repeats}"
        )
        print(f"{'budget MiB':>10} {'seconds':>8} {'host MiB beyond the result':>27}")
        for budget in args.budgets:
            runs = []
            for _ in range(args.repeats):
                command = [sys.executable, __file__, "--worker", path, str(args.gib), str(budget), args.spec]
                done = subprocess.run(
                    [*command, str(args.leaves), args.cast or "-"], capture_output=True, text=True, env=env
                )
                if done.returncode:
                    raise SystemExit(done.stderr[-3000:])
                runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
            seconds = statistics.median(r["seconds"] for r in runs)
            extra = statistics.median(r["extra_mib"] for r in runs)
            print(f"{budget:>10} {seconds:>8.2f} {extra:>27.0f}")


if __name__ == "__main__":
    main()
