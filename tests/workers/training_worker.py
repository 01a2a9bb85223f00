"""A small training run with a CheckpointManager, resumable; started by tests/test_manager.py.

    python training_worker.py DIRECTORY STEPS [--keep-all]

Each step's batch comes from the step number alone, so a run resumed from a
checkpoint continues exactly as an uninterrupted one would. Prints
``committed N`` once step N's save is started, so the test can kill it anywhere.
"""

import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import eqxckpt

OPTIM = optax.adam(1e-2)


def make_state():
    model = eqx.nn.MLP(in_size=4, out_size=1, width_size=64, depth=2, key=jax.random.key(0))
    return {"model": model, "opt_state": OPTIM.init(eqx.filter(model, eqx.is_array))}


@eqx.filter_jit
def train_step(state, step):
    key = jax.random.fold_in(jax.random.key(1), step)
    x = jax.random.normal(key, (32, 4))
    y = jnp.sin(jnp.sum(x, axis=1, keepdims=True))
    loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(state["model"])
    updates, opt_state = OPTIM.update(grads, state["opt_state"], eqx.filter(state["model"], eqx.is_array))
    return {"model": eqx.apply_updates(state["model"], updates), "opt_state": opt_state}, loss


def main(directory: str, steps: int, keep_all: bool) -> None:
    state = make_state()
    with eqxckpt.CheckpointManager(directory, max_to_keep=None if keep_all else 2) as manager:
        start = manager.latest_step()
        if start is not None:
            state = manager.load(state)  # the saved step is the state *after* that step
            print(f"resumed from {start}", flush=True)
        for step in range(0 if start is None else start + 1, steps):
            state, loss = train_step(state, jnp.asarray(step))  # an array: one compilation
            manager.save(step, state, metrics={"loss": float(loss)})
            print(f"saving {step}", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), "--keep-all" in sys.argv)
