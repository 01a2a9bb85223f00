"""Save and full-load times of eqxckpt against its peers, measured in one run.

Workload: an Equinox model (bf16 embedding, f32 linear layers, an int32 buffer)
plus its `optax.adam` state with non-zero moments, about ``--mib`` MiB in all.
Peers on the same state, same disk, same run:

- raw: every array's bytes written to one file with plain writes + fsync,
  read back with ``readinto`` into preallocated numpy buffers (the disk's limit);
- eqxckpt: ``save`` (durable: data, manifest and directories fsync'd) and
  ``load`` into an ``eqx.filter_eval_shape`` skeleton;
- orbax: ``StandardCheckpointer`` save (+ ``wait_until_finished``) and restore
  into the same skeleton;
- eqx.tree_serialise_leaves / tree_deserialise_leaves (note: it never fsyncs).

Loads read from a warm page cache for every peer alike. Prints medians with
min-max and the ratio to raw; ``--json`` writes the figures to a file.

Async line: how long ``eqxckpt.save(..., blocking=False)`` blocks the caller
(the host snapshot) and how long until the checkpoint is committed, next to a
blocking eqxckpt save and to Orbax's async ``StandardCheckpointer.save`` (time
until it returns, then until ``wait_until_finished``), same state, same run.

    python benchmarks/bench_save_load.py --mib 256 --repeats 3
"""

import argparse
import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqxckpt


class Block(eqx.Module):
    norm: jax.Array
    attn: eqx.nn.Linear
    mlp_in: eqx.nn.Linear
    mlp_out: eqx.nn.Linear

    def __init__(self, d: int, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm = jnp.ones(d)
        self.attn = eqx.nn.Linear(d, d, key=k1)
        self.mlp_in = eqx.nn.Linear(d, 4 * d, key=k2)
        self.mlp_out = eqx.nn.Linear(4 * d, d, key=k3)


class Model(eqx.Module):
    embed: jax.Array
    blocks: list
    positions: jax.Array

    def __init__(self, d: int, layers: int, vocab: int, key):
        k0, *ks = jax.random.split(key, layers + 1)
        self.embed = jax.random.normal(k0, (vocab, d), jnp.bfloat16)
        self.blocks = [Block(d, k) for k in ks]
        self.positions = jnp.arange(4096, dtype=jnp.int32)


def training_state(mib: float, layers: int = 8):
    """A model + adam state of about ``mib`` MiB; returns (arrays-only state, constructor)."""
    # params ~ layers * 9 d^2 floats; adam adds mu and nu: total ~ 3x params.
    d = max(32, round((mib * 2**20 / 3 / 4 / (9 * layers + 4)) ** 0.5 / 32) * 32)

    def make():
        model = Model(d, layers, vocab=4 * d, key=jax.random.key(0))
        params = eqx.filter(model, eqx.is_array)
        opt_state = optax.adam(1e-3).init(params)
        # non-zero moments, as after a few steps
        opt_state = jax.tree_util.tree_map(lambda x: x + 0.5 if eqx.is_inexact_array(x) else x, opt_state)
        return {"model": params, "opt_state": opt_state}

    return make(), make


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))


# --- the peers --------------------------------------------------------------------------


def raw_save(path, state):
    with open(path, "wb") as f:
        for leaf in jax.tree_util.tree_leaves(state):
            f.write(np.ascontiguousarray(np.asarray(leaf)).reshape(-1).view(np.uint8))
        f.flush()
        os.fsync(f.fileno())


def raw_load(path, skeleton):
    leaves, treedef = jax.tree_util.tree_flatten(skeleton)
    out = []
    with open(path, "rb", buffering=0) as f:
        for s in leaves:
            buf = np.empty(s.shape, s.dtype)
            f.readinto(buf.reshape(-1).view(np.uint8))
            out.append(jnp.asarray(buf))
    return jax.tree_util.tree_unflatten(treedef, out)


def eqxckpt_save(path, state):
    eqxckpt.save(path, state)


def eqxckpt_load(path, skeleton):
    return eqxckpt.load(path, skeleton)


def serialise_save(path, state):
    eqx.tree_serialise_leaves(path, state)


def serialise_load(path, skeleton):
    like = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), skeleton)
    return eqx.tree_deserialise_leaves(path, like)


def _orbax():
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer()


def orbax_save(path, state):
    ckptr = _orbax()
    ckptr.save(path, state)
    ckptr.wait_until_finished()


def orbax_load(path, skeleton):
    return _orbax().restore(path, skeleton)


PEERS = {
    "raw (write+fsync / readinto)": (raw_save, raw_load),
    "eqxckpt": (eqxckpt_save, eqxckpt_load),
    "orbax StandardCheckpointer": (orbax_save, orbax_load),
    "eqx.tree_serialise_leaves": (serialise_save, serialise_load),
}


def block(tree):
    jax.tree_util.tree_map(lambda x: x.block_until_ready() if isinstance(x, jax.Array) else x, tree)
    return tree


def measure(name, save_fn, load_fn, state, skeleton, root: pathlib.Path, repeats: int) -> dict:
    saves, loads = [], []
    for i in range(repeats):
        path = root / f"{name.split()[0]}-{i}"
        t0 = time.perf_counter()
        save_fn(path, state)
        saves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        restored = block(load_fn(path, skeleton))
        loads.append(time.perf_counter() - t0)
        if i == 0:  # a benchmark of wrong answers is worthless
            for a, b in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(state)):
                assert np.array_equal(np.asarray(a), np.asarray(b)), f"{name} restored wrong values"
        del restored
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return {"save": saves, "load": loads}


def measure_async(state, root: pathlib.Path, repeats: int) -> dict:
    """Seconds the caller is blocked, and seconds until committed, per async saver."""
    import orbax.checkpoint as ocp

    out = {"eqxckpt save(blocking=True)": ([], []), "eqxckpt save(blocking=False)": ([], []),
           "orbax StandardCheckpointer (async)": ([], [])}
    ckptr = ocp.StandardCheckpointer()  # built outside the timing, as a training loop would
    for i in range(repeats):
        for name, (blocked, committed) in out.items():
            path = root / f"async-{name.split()[0]}-{name.count('False')}-{i}"
            t0 = time.perf_counter()
            if name.startswith("orbax"):
                ckptr.save(path, state)
                blocked.append(time.perf_counter() - t0)
                ckptr.wait_until_finished()
            else:
                handle = eqxckpt.save(path, state, blocking="True" in name)
                blocked.append(time.perf_counter() - t0)
                handle.wait()
            committed.append(time.perf_counter() - t0)
            shutil.rmtree(path)
    return out


def report_async(results: dict) -> str:
    lines = [f"async: caller blocked vs until committed, medians of {len(next(iter(results.values()))[0])}",
             f"{'':36} {'blocked s':>9} {'committed s':>11}"]
    for name, (blocked, committed) in results.items():
        lines.append(f"{name:36} {statistics.median(blocked):9.3f} {statistics.median(committed):11.3f}")
    return "\n".join(lines)


def report(results: dict, state_bytes: int) -> str:
    raw = {op: statistics.median(results[next(iter(PEERS))][op]) for op in ("save", "load")}
    lines = [f"state: {state_bytes / 2**20:.0f} MiB in {results['_leaves']} leaves; medians of {results['_repeats']} (min-max); ratio to raw",
             f"{'':32} {'save s':>8} {'(min-max)':>15} {'x raw':>6}   {'load s':>8} {'(min-max)':>15} {'x raw':>6}"]
    for name in PEERS:
        row = results[name]
        cells = []
        for op in ("save", "load"):
            med = statistics.median(row[op])
            cells.append(f"{med:8.3f} {f'({min(row[op]):.3f}-{max(row[op]):.3f})':>15} {med / raw[op]:6.2f}")
        lines.append(f"{name:32} {cells[0]}   {cells[1]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, default=256, help="approximate size of the training state")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir on the work disk)")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    state, make = training_state(args.mib)
    state = block(state)
    skeleton = eqx.filter_eval_shape(make)
    root = pathlib.Path(tempfile.mkdtemp(prefix="eqxckpt-bench-", dir=args.dir or os.getcwd()))
    try:
        results = {"_leaves": len(jax.tree_util.tree_leaves(state)), "_repeats": args.repeats}
        for name, (save_fn, load_fn) in PEERS.items():
            print(f"measuring {name} ...", file=sys.stderr, flush=True)
            results[name] = measure(name, save_fn, load_fn, state, skeleton, root, args.repeats)
        print("measuring async saves ...", file=sys.stderr, flush=True)
        async_results = measure_async(state, root, args.repeats)
        results["_async"] = {name: {"blocked": b, "committed": c} for name, (b, c) in async_results.items()}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(report(results, nbytes(state)))
    print(report_async(async_results))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
