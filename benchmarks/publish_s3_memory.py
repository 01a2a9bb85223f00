"""Host memory of one process writing a sharded safetensors model to S3 (moto on
127.0.0.1, started here): the peak resident memory over what it held before, per shard
limit. An object is written whole, so a writer holds its file as it gathers it and
again as TensorStore takes it.

    PYTHONPATH=. .venv/bin/python benchmarks/publish_s3_memory.py [--mib 256] [--limits 100MB 200MB]
"""

import argparse
import os
import pathlib
import socket
import subprocess
import sys
import time
import urllib.request

from publish import kib, peak_reset  # beside this script


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--limits", nargs="+", default=["100MB", "200MB"])
    args = parser.parse_args()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = pathlib.Path(sys.executable).parent / "moto_server"
    moto = subprocess.Popen(
        [str(server), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        for _ in range(200):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}", timeout=1)
                break
            except OSError:
                time.sleep(0.05)
        os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_REGION="us-east-1")
        os.environ["TENSORSTORE_S3_USE_CONDITIONAL_WRITE"] = "1"
        import boto3
        import numpy as np

        import eqxckpt

        endpoint = f"http://127.0.0.1:{port}"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="publish-memory")
        spec = {
            "driver": "s3",
            "bucket": "publish-memory",
            "endpoint": endpoint,
            "aws_region": "us-east-1",
            "aws_credentials": {"type": "environment"},
        }
        count = args.mib // 32
        tree = {f"w{i}": np.full((1024, 8192), i, np.float32) for i in range(count)}  # 32 MiB each
        eqxckpt.save_safetensors({**spec, "path": "warm-up/"}, {"a": np.ones(4, np.float32)}, max_shard_size="1MB")
        print(f"{args.mib} MiB in {count} tensors of 32 MiB, one process, to moto S3")
        print("| shard limit | peak over held (MiB) | time (s) |")
        print("|---|---|---|")
        for limit in args.limits:
            before = peak_reset()
            start = time.perf_counter()
            eqxckpt.save_safetensors({**spec, "path": f"model-{limit}/"}, tree, max_shard_size=limit, progress=False)
            seconds = time.perf_counter() - start
            print(f"| {limit} | {(kib('VmHWM') - before) // 1024} | {seconds:.2f} |")
    finally:
        moto.terminate()
        moto.wait()


if __name__ == "__main__":
    main()
