"""The benchmarks' shared parts: the workloads (built identically in every process), each
library's save and restore, and the file and process helpers. `bench.py`,
`device_bench.py`, `profile_ops.py` and the incremental benchmarks import it; run as
scripts, they find it beside them."""

import json
import os
import pathlib
import shutil
import subprocess
import time

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
        return jax.device_put((rng.random(shape, dtype=np.float32) - 0.5).astype(dtype))

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
        return jax.device_put(rng.random(size, dtype=np.float32) - 0.5)

    per_block = 100
    return {
        f"block_{b}": {
            f"p{i}": fill(int(sizes[b * per_block + i])) for i in range(min(per_block, count - b * per_block))
        }
        for b in range((count + per_block - 1) // per_block)
    }


def frozen_base(mib: int) -> dict:
    """The frozen model of the incremental benchmarks: ``mib // 64`` jax.Arrays of 64 MiB."""
    import jax
    import numpy as np

    rng = np.random.default_rng(0)
    return {f"layer{i}": jax.device_put(rng.standard_normal((4096, 4096), np.float32)) for i in range(mib // 64)}


def adapter_state(step: int) -> dict:
    """The trained part of the incremental benchmarks at ``step``: a 16 MiB adapter (32
    leaves of 512 KiB) with its adam state (mu, nu), 48 MiB in all; new values each step."""
    import jax
    import numpy as np

    step_rng = np.random.default_rng(step)
    adapter = {f"lora{i}": jax.device_put(step_rng.standard_normal((4096, 32), np.float32)) for i in range(32)}
    return {
        "adapter": adapter,
        "opt": {"mu": {k: v * 0.1 for k, v in adapter.items()}, "nu": {k: v * v for k, v in adapter.items()}},
        "count": np.int32(step),
    }


def build(workload: str, abstract: bool = False):
    """The state of a workload name: ``model:MIB`` or ``leaves:COUNT``."""
    kind, size = workload.split(":")
    if kind == "leaves":
        return many_leaf_state(int(size), abstract)
    return transformer_state(float(size), abstract)


def params_of(tree):
    return tree["model"] if "model" in tree else tree


# --- the peers' operations ---------------------------------------------------------------


def _leaf_bytes(state):
    import jax
    import numpy as np

    return [np.ascontiguousarray(leaf).reshape(-1).view(np.uint8) for leaf in jax.tree_util.tree_leaves(state)]


def _raw_save(path, state):
    with open(path, "wb", buffering=0) as f:
        for data in _leaf_bytes(state):
            f.write(data)


def _raw_restore(path, skeleton, wanted=None):
    """readinto numpy buffers; with ``wanted`` (leaf indices) only those byte ranges."""
    import jax
    import numpy as np

    leaves = jax.tree_util.tree_leaves(skeleton)
    out = []
    offset = 0
    with open(path, "rb", buffering=0) as f:
        for i, s in enumerate(leaves):
            size = int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
            if wanted is None or i in wanted:
                buf = np.empty(s.shape, s.dtype)
                f.seek(offset)
                f.readinto(memoryview(buf.reshape(-1).view(np.uint8)))
                out.append(buf)
            offset += size
    return out


def fsync_tree(path: pathlib.Path) -> None:
    """fsync every file and directory at ``path`` and the directory holding it."""
    targets = [path] if path.is_file() else [pathlib.Path(d, n) for d, _, ns in os.walk(path) for n in ns]
    targets += [] if path.is_file() else [pathlib.Path(d) for d, _, _ in os.walk(path)]
    for target in targets + [path.parent]:
        fd = os.open(target, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def op_save(peer, path, state):
    import eqxckpt

    if peer in ("raw", "floor"):
        _raw_save(path, state)
    elif peer == "eqxckpt":
        eqxckpt.save(path, state)
    elif peer == "eqxckpt-unpacked":  # the layout before packed leaves: one array per leaf
        import eqxckpt._write._save

        eqxckpt._write._save.PACK_MIN_LEAVES = 1 << 62
        eqxckpt.save(path, state)
    else:
        import orbax.checkpoint as ocp

        ckptr = ocp.StandardCheckpointer()
        ckptr.save(path, state)
        ckptr.wait_until_finished()
    fsync_tree(pathlib.Path(path))  # durable, for every peer alike (a no-op's cost for eqxckpt)


def op_restore(peer, path, skeleton, params_only):
    import jax

    import eqxckpt

    if peer in ("raw", "floor"):
        wanted = set(range(len(jax.tree_util.tree_leaves(skeleton["model"])))) if params_only else None
        arrays = _raw_restore(path, skeleton, wanted)
        if peer == "floor":  # JAX's own cost of making the arrays: one batched device_put of them all
            arrays = jax.block_until_ready(jax.device_put(arrays))
        return arrays
    if peer.startswith("eqxckpt"):
        out = eqxckpt.load(path, skeleton["model"], at="model") if params_only else eqxckpt.load(path, skeleton)
    else:
        import orbax.checkpoint as ocp

        if params_only:
            target = {"model": skeleton["model"]}
            restore_args = ocp.checkpoint_utils.construct_restore_args(target)
            out = ocp.PyTreeCheckpointer().restore(
                path, args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True)
            )
        else:
            out = ocp.StandardCheckpointer().restore(path, skeleton)
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
        import orbax.checkpoint as ocp

        ckptr = ocp.StandardCheckpointer()  # built before timing, as a training loop would
        t0 = time.perf_counter()
        ckptr.save(path, state)
        blocked = time.perf_counter() - t0
        ckptr.wait_until_finished()
    return blocked, time.perf_counter() - t0


# S3: eqxckpt saves to a kvstore spec; "raw" is one object holding every leaf's bytes,
# written and read with TensorStore's s3 kvstore (the HTTP client eqxckpt uses too).
BUCKET = "eqxckpt-bench"


def s3_spec(prefix: str) -> dict:
    return {
        "driver": "s3",
        "bucket": BUCKET,
        "path": prefix,
        "endpoint": os.environ["EQXCKPT_BENCH_S3"],
        "aws_region": "us-east-1",
        "aws_credentials": {"type": "environment"},
    }


def op_s3(peer, op, prefix, state_or_skeleton):
    import jax
    import numpy as np
    import tensorstore as ts

    import eqxckpt

    if peer == "orbax":  # tried once, to report whether it can
        import orbax.checkpoint as ocp

        ckptr = ocp.StandardCheckpointer()
        ckptr.save(f"s3://{BUCKET}/{prefix}", state_or_skeleton)
        ckptr.wait_until_finished()
        return None
    if peer == "eqxckpt":
        if op == "save":
            eqxckpt.save(s3_spec(prefix + "/"), state_or_skeleton)
            return None
        return jax.block_until_ready(jax.tree_util.tree_leaves(eqxckpt.load(s3_spec(prefix + "/"), state_or_skeleton)))
    store = ts.KvStore.open(s3_spec(prefix + "/")).result()
    if op == "save":
        store.write("state.bin", b"".join(_leaf_bytes(state_or_skeleton))).result()
        return None
    data = store.read("state.bin").result().value
    out, offset = [], 0
    for s in jax.tree_util.tree_leaves(state_or_skeleton):
        size = int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
        out.append(np.frombuffer(data, s.dtype, int(np.prod(s.shape)), offset).reshape(s.shape))
        offset += size
    return out


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


def _warm_up(peer: str, scratch: pathlib.Path) -> None:
    """A tiny save and restore with the same peer: lazy imports, thread pools and
    tracing caches are set up before the timed operation, as in a running job."""
    import jax
    import jax.numpy as jnp

    tiny = {"model": {"w": jnp.ones((8, 8)), "b": jnp.arange(4)}, "opt_state": {"mu": jnp.ones(3, jnp.bfloat16)}}
    skeleton = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tiny)
    path = scratch / f"warm-up-{peer}-{os.getpid()}"
    remove(path)
    try:
        op_save(peer, path, tiny)
        op_restore(peer, path, skeleton, False)
    finally:
        remove(path)


def _prefault(nbytes: int) -> None:
    """Touch and free ``nbytes`` of memory: this VM hands freed pages back to its host,
    and the first touch of such a page costs ~1.5 s/GiB; an operation that happens to
    allocate them would be billed for the VM, not for its own work."""
    import numpy as np

    buffer = np.empty(nbytes, np.uint8)
    buffer[::4096] = 1
    del buffer


def run_json(command: list[str], what: str, env: dict | None = None, cwd: str | None = None) -> dict:
    """Run a worker process (in ``cwd``, if given); its last line of output, as JSON."""
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **(env or {})}, cwd=cwd)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def files_of(path: pathlib.Path) -> list[pathlib.Path]:
    return [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]


def warm(path: pathlib.Path) -> None:
    for p in files_of(path):
        with open(p, "rb") as f:
            while f.read(1 << 24):
                pass


def drop(path: pathlib.Path) -> None:
    """Evict the checkpoint's pages from the page cache."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return
    except OSError:
        pass
    for p in files_of(path):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def remove(path: pathlib.Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
