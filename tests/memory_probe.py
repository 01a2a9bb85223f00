"""Peak memory of one eqxckpt operation, measured in a fresh process (Linux).

    python memory_probe.py save|save_async|load|load_params|copy|to_safetensors|from_safetensors PATH

Prints JSON: the peak RSS above the level just before the operation, and the
bytes saved or restored.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import eqxckpt


def state():
    """~192 MiB: params of 64 MiB and two moments of the same size, 24 leaves."""
    rng = np.random.default_rng(0)

    def layer():
        return {
            "w": jnp.asarray(rng.standard_normal((1024, 2048), np.float32)),
            "b": jnp.asarray(rng.standard_normal(2048, np.float32)),
        }

    params = {"layers": [layer() for _ in range(8)]}

    def moment():
        return jax.tree_util.tree_map(lambda x: jnp.asarray(rng.standard_normal(x.shape, np.float32)), params)

    return {"model": params, "opt": {"mu": moment(), "nu": moment()}}


def kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def main(op, path):
    def nbytes(t):
        return sum(x.nbytes for x in jax.tree_util.tree_leaves(t))

    if op in ("copy", "to_safetensors", "from_safetensors"):  # PATH is the source; the copy goes beside it
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = kib("VmRSS")
        source = eqxckpt.open(path + ".safetensors" if op == "from_safetensors" else path)
        if op == "to_safetensors":
            eqxckpt.save_safetensors(path + ".safetensors", source.tree())
        else:
            eqxckpt.save(path + "-" + op, source.tree())
        print(json.dumps({"peak": (kib("VmHWM") - before) * 1024, "bytes": source.nbytes}))
        return
    if op.startswith("load"):
        # The state is built only after the load, to check it: memory it
        # freed would otherwise be reused and hide the load's own growth.
        like = jax.eval_shape(state)
        like = like["model"] if op == "load_params" else like
    else:
        tree = state()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak
    before = kib("VmRSS")
    if op == "save":
        eqxckpt.save(path, tree)
        size = nbytes(tree)
    elif op == "save_async":
        eqxckpt.save(path, tree, blocking=False).wait()
        size = nbytes(tree)
    else:
        out = eqxckpt.load(path, like, at="model" if op == "load_params" else None)
        size = nbytes(out)
    peak = (kib("VmHWM") - before) * 1024
    if op.startswith("load"):
        expected = state()["model"] if op == "load_params" else state()
        assert all(
            np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(expected))
        )
    print(json.dumps({"peak": peak, "bytes": size}))


if __name__ == "__main__":
    main(*sys.argv[1:])
