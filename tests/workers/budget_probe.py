"""Peak host memory and bytes downloaded of a single-process restore from an
object store with a small host_memory_budget.

    python budget_probe.py STORE_SPEC_JSON MIB BUDGET TARGET

TARGET: ``device`` (a jax array on one device), ``numpy`` (like=None), ``rows2`` /
``cols2`` (two CPU devices, rows or columns) or ``grid4`` (two rows of MIB / 2 MiB each,
split both ways over a 2x2 mesh of four CPU devices). Prints one line ``PROBE <json>``.
"""

import gc
import json
import os
import sys
import zlib

TARGET = sys.argv[4]
if TARGET in ("rows2", "cols2", "grid4"):
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={4 if TARGET == 'grid4' else 2}"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import tensorstore as ts  # noqa: E402

import eqxckpt  # noqa: E402


def vm() -> dict:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f.read().splitlines())
    return {k: int(fields[k].split()[0]) // 1024 for k in ("VmHWM", "VmRSS")}


def downloaded() -> int:
    total = 0
    for metric in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/"):
        if metric["name"].endswith("/bytes_read"):
            total += sum(v.get("value", 0) for v in metric["values"])
    return total


def main() -> None:
    spec, mib, budget = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    shape = (2, mib * 1024 * 128) if TARGET == "grid4" else (mib * 1024, 256)
    value = np.random.default_rng(zlib.crc32(b"probe")).standard_normal(shape).astype(np.float32)
    eqxckpt.save(spec, {"w": value})
    del value
    jax.devices()
    if TARGET == "device":
        like = {
            "w": jax.ShapeDtypeStruct(shape, np.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
        }
    elif TARGET in ("rows2", "cols2"):
        mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
        spec_ = jax.sharding.PartitionSpec("x") if TARGET == "rows2" else jax.sharding.PartitionSpec(None, "x")
        like = {"w": jax.ShapeDtypeStruct(shape, np.float32, sharding=jax.sharding.NamedSharding(mesh, spec_))}
    elif TARGET == "grid4":
        mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2), ("x", "y"))
        grid = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", "y"))
        like = {"w": jax.ShapeDtypeStruct(shape, np.float32, sharding=grid)}
    else:
        like = None
    # Warm up JAX on a tiny array so compile/runtime allocations are not counted.
    jax.block_until_ready(jax.device_put(np.zeros((8, 8), np.float32)))
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base, read0 = vm(), downloaded()
    restored = eqxckpt.load(spec, like, host_memory_budget=budget)
    restored = jax.block_until_ready(restored)
    peak, read = vm(), downloaded() - read0
    want = np.random.default_rng(zlib.crc32(b"probe")).standard_normal(shape).astype(np.float32)
    exact = np.asarray(restored["w"]).tobytes() == want.tobytes()
    print(
        "PROBE "
        + json.dumps(
            {
                "mib": mib,
                "budget_mib": budget / 2**20,
                "target": TARGET,
                "beyond_result_mib": peak["VmHWM"] - base["VmRSS"] - mib,
                "downloaded_mib": round(read / 2**20, 1),
                "exact": exact,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
