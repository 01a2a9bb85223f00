"""Incremental checkpoints on an object store: a frozen base + a 16 MiB adapter with its
adam state, saved by `CheckpointManager` every step to S3 (moto's server, in a process
of its own on 127.0.0.1), against saving the adapter and its optimizer state alone
there. Bytes written per step are the sizes of the objects under the step's own prefix;
bytes downloaded per step are what TensorStore counted reading (its kvstore metrics:
the base's bytes, when a step checks them whole before sharing them). Medians over the
steps after the first.

    .venv/bin/python benchmarks/incremental_objects.py [BASE_MIB]
"""

import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

from workloads import adapter_state, frozen_base  # beside this script

BUCKET = "bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto() -> tuple[subprocess.Popen, str]:
    port = free_port()
    moto = os.path.join(os.path.dirname(sys.executable), "moto_server")
    server = subprocess.Popen([moto, "-H", "127.0.0.1", "-p", str(port)], stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{BUCKET}", method="PUT")).close()
            return server, endpoint
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("moto_server did not start")


def main() -> None:
    base_mib = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_EC2_METADATA_DISABLED="true",
        TENSORSTORE_S3_USE_CONDITIONAL_WRITE="1",
    )
    server, endpoint = start_moto()
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    try:
        import boto3

        import eqxckpt

        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")

        def stored(prefix: str) -> int:
            total, token = 0, None
            while True:
                page = client.list_objects_v2(
                    Bucket=BUCKET, Prefix=prefix, **({"ContinuationToken": token} if token else {})
                )
                total += sum(obj["Size"] for obj in page.get("Contents", []))
                token = page.get("NextContinuationToken")
                if not token:
                    return total

        import tensorstore as ts

        def downloaded() -> int:
            metrics = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/")
            return sum(v.get("value", 0) for m in metrics if m["name"].endswith("/bytes_read") for v in m["values"])

        base = frozen_base(base_mib)

        steps = 6
        rows = []
        with eqxckpt.CheckpointManager(f"s3://{BUCKET}/run", max_to_keep=3, blocking=True) as manager:
            for step in range(steps):
                start, read = time.perf_counter(), downloaded()
                manager.save(step, {"base": base, **adapter_state(step)}, force=True)
                seconds, read = time.perf_counter() - start, downloaded() - read
                own = [k for k in client.list_objects_v2(Bucket=BUCKET, Prefix=f"run/{step}/").get("Contents", [])]
                written = stored(f"run/{step}/") - sum(o["Size"] for o in own if "%holds" in o["Key"])
                rows.append((seconds, written, read))
        alone = []
        for step in range(steps):
            start = time.perf_counter()
            eqxckpt.save(f"s3://{BUCKET}/alone{step}", adapter_state(step))
            alone.append((time.perf_counter() - start, stored(f"alone{step}/")))
        later_s, later_b = statistics.median(r[0] for r in rows[1:]), statistics.median(r[1] for r in rows[1:])
        alone_s, alone_b = statistics.median(r[0] for r in alone[1:]), statistics.median(r[1] for r in alone[1:])
        print(f"S3 (moto), base {base_mib} MiB, adapter + adam 48 MiB, {steps} steps, 3 kept")
        print(f"first step: {rows[0][0]:.2f} s, {rows[0][1] / 2**20:.0f} MiB written")
        print(f"later steps: {later_s:.3f} s, {later_b / 2**20:.1f} MiB written per step (median)")
        print(f"adapter + optimizer alone: {alone_s:.3f} s, {alone_b / 2**20:.1f} MiB")
        print(f"ratio: time {later_s / alone_s:.2f}x, bytes {later_b / alone_b:.2f}x")
        print("downloaded per step (MiB): " + ", ".join(f"{r[2] / 2**20:.2f}" for r in rows))
        print(f"stored for {len(manager.all_steps())} kept steps: {stored('run/') / 2**20:.0f} MiB")
        eqxckpt.save(f"s3://{BUCKET}/whole", {"base": base, **adapter_state(steps - 1)})  # no base: all its own
        places = [f"s3://{BUCKET}/whole", manager.path(steps - 1)]
        loads: list[list[float]] = [[], []]
        for _ in range(3):
            for where, times in zip(places, loads):
                start = time.perf_counter()
                eqxckpt.load(where)
                times.append(time.perf_counter() - start)
        whole, latest = (statistics.median(t) for t in loads)
        print(f"restore, median of 3: written whole {whole:.2f} s, step {steps - 1} (referring) {latest:.2f} s")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
