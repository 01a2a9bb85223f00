"""Host memory and time of a restore onto several devices, at several host-memory budgets.

    python benchmarks/host_budget.py --gib 2 --devices 8 --budgets 64 256 4096 --repeats 3 [--spec columns]

Saves a float32 state of ``--gib`` GiB (16 leaves) once, then restores it in a
fresh process per run onto ``--devices`` devices (CPU devices made by
``--xla_force_host_platform_device_count`` unless a GPU is present), split by
``--spec``: rows (``P("x", None)``, the default), columns (``P(None, "x")``) or
replicated (``P()``: every device holds the whole leaf), with ``load(..., host_memory_budget=...)`` (0: the argument is not
passed, so eqxckpt versions without it can be measured the same way, with
``PYTHONPATH`` pointing at their checkout). Reports the peak RSS
above the RSS before the load (``VmHWM``, reset first), minus the restored
bytes (on CPU devices the result itself is in host memory), and the time.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

LEAVES = 16


SPECS = {"rows": ("x", None), "columns": (None, "x"), "replicated": ()}


def worker(path: str, gib: float, budget_mib: int, spec: str = "rows") -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import eqxckpt

    rows = int(gib * 2**30 / LEAVES / 4 / 4096) // 8 * 8
    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*SPECS[spec]))
    like = {f"w{i}": jax.ShapeDtypeStruct((rows, 4096), jnp.float32, sharding=sharding) for i in range(LEAVES)}

    def kib(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = kib("VmRSS")
    import time

    started = time.perf_counter()
    budget: dict = {} if budget_mib == 0 else {"host_memory_budget": budget_mib << 20}  # 0: load's default
    out = jax.block_until_ready(eqxckpt.load(path, like, **budget))
    seconds = time.perf_counter() - started
    peak = (kib("VmHWM") - before) * 1024
    restored = LEAVES * rows * 4096 * 4
    on_host = all(d.platform == "cpu" for d in devices)
    for i in range(LEAVES):
        assert all((np.asarray(s.data) == i).all() for s in out[f"w{i}"].addressable_shards)
    extra = peak - (restored if on_host else 0)
    print(json.dumps({"seconds": seconds, "extra_mib": extra / 2**20, "restored_mib": restored / 2**20}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 256, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--spec", choices=sorted(SPECS), default="rows")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], float(args.worker[1]), int(args.worker[2]), args.worker[3])
        return
    env = dict(os.environ, MALLOC_TRIM_THRESHOLD_=str(128 * 1024))
    env.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.devices}")
    with tempfile.TemporaryDirectory(prefix="eqxckpt-host-budget-") as root:
        path = os.path.join(root, "ckpt")
        import numpy as np

        import eqxckpt

        rows = int(args.gib * 2**30 / LEAVES / 4 / 4096) // 8 * 8
        eqxckpt.save(path, {f"w{i}": np.full((rows, 4096), i, np.float32) for i in range(LEAVES)})
        print(f"{args.gib} GiB in {LEAVES} leaves onto {args.devices} devices by {args.spec}; median of {args.repeats}")
        print(f"{'budget MiB':>10} {'seconds':>8} {'host MiB beyond the result':>27}")
        for budget in args.budgets:
            runs = []
            for _ in range(args.repeats):
                done = subprocess.run(
                    [sys.executable, __file__, "--worker", path, str(args.gib), str(budget), args.spec],
                    capture_output=True,
                    text=True,
                    check=True,
                    env=env,
                )
                runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
            seconds = statistics.median(r["seconds"] for r in runs)
            extra = statistics.median(r["extra_mib"] for r in runs)
            print(f"{budget:>10} {seconds:>8.2f} {extra:>27.0f}")


if __name__ == "__main__":
    main()
