"""The README story end to end: train, save model + optimizer state, inspect, restore the params alone."""

import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import eqxckpt


def human_bytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def make_model(key=None):
    key = jax.random.key(0) if key is None else key
    return eqx.nn.MLP(in_size=8, out_size=1, width_size=256, depth=3, key=key)


def train(steps: int):
    model = make_model()
    optim = optax.adamw(3e-3)
    opt_state = optim.init(eqx.filter(model, eqx.is_array))
    x = jax.random.normal(jax.random.key(1), (512, 8))
    y = jnp.sin(x).sum(axis=1, keepdims=True)

    @eqx.filter_jit
    def step(model, opt_state):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(model)
        updates, opt_state = optim.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, loss

    for _i in range(steps):
        model, opt_state, loss = step(model, opt_state)
    return model, opt_state, float(loss)


def main() -> None:
    root = pathlib.Path(tempfile.mkdtemp(prefix="eqxckpt-demo-"))
    try:
        model, opt_state, loss = train(steps=50)
        print(f"trained 50 steps, loss {loss:.4f}")

        path = root / "run" / "step_50"
        t0 = time.perf_counter()
        eqxckpt.save(
            path,
            {"model": model, "opt_state": opt_state, "step": 50},
            metadata={"step": 50, "loss": loss, "width": 256},
        )
        took = time.perf_counter() - t0
        ckpt = eqxckpt.open(path)
        files = sum(1 for p in path.rglob("*") if p.is_file())
        print(
            f"\nsaved {len(ckpt)} leaves ({human_bytes(ckpt.nbytes)}, {files} files) to {path} in {took * 1000:.0f} ms"
        )

        print("\n$ eqxckpt inspect", path, "--at model")
        subprocess.run([sys.executable, "-m", "eqxckpt", "inspect", str(path), "--at", "model"], check=True)

        t0 = time.perf_counter()
        restored = eqxckpt.load(path, eqx.filter_eval_shape(make_model), at="model")
        took = time.perf_counter() - t0
        model_bytes = sum(r.nbytes for r in ckpt.records("model").values())
        print(
            f"\nrestored the params alone ({human_bytes(model_bytes)} of {human_bytes(ckpt.nbytes)}) "
            f"into a filter_eval_shape skeleton in {took * 1000:.0f} ms"
        )
        same = all(
            jnp.array_equal(a, b)
            for a, b in zip(
                jax.tree_util.tree_leaves(eqx.filter(restored, eqx.is_array)),
                jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array)),
            )
        )
        x = jnp.ones(8)
        print(f"bit-exact: {same}; model(ones) = {float(restored(x)[0]):.6f} (trained: {float(model(x)[0]):.6f})")
        assert same
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
