"""Two JAX processes of two CPU devices each, a local tier whose parts hold several blocks
(tests/test_local.py, the damage found as a restore reads it).

Scenarios: ``save`` (steps 0-6; persistent every 4, local every step, one peer copy,
two local steps kept) and ``resume``: ``latest_step()`` then ``load`` onto ``LIKE``
(``same`` or ``finer``; ``AT``: that leaf only), ``TRIES`` times; ``GONE_<k>``: paths process k deletes between
them. Each try prints ``TRY <t> latest=<step> LOADED <step> <bit-exact>`` or ``TRY <t>
latest=<step> RAISED <class>: <message>``.
"""

import os
import shutil
import warnings

import jax
import numpy as np
from distributed_worker import run_scenarios
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import eqxckpt

SPECS = {"same": {"w": P("p"), "u": P(("p", "d"))}, "finer": {"w": P(("p", "d")), "u": P(("p", "d"))}}


def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(2, 2), ("p", "d"))


def values(step: int, name: str) -> np.ndarray:
    return np.arange(8 * 16, dtype=np.float32).reshape(8, 16) * (1 if name == "w" else -1) + 1000 * step


def manager(directory: str) -> eqxckpt.CheckpointManager:
    return eqxckpt.CheckpointManager(
        f"{directory}/run",
        save_interval_steps=4,
        local_path=f"{directory}/host{jax.process_index()}",
        local_interval_steps=1,
        local_replicas=1,
        local_max_to_keep=2,
    )


def save(directory: str) -> None:
    with manager(directory) as m:
        for step in range(7):
            sharded = {
                name: jax.make_array_from_callback(
                    (8, 16), NamedSharding(mesh(), SPECS["same"][name]), lambda i, n=name, s=step: values(s, n)[i]
                )
                for name in ("w", "u")
            }
            m.save(step, {**sharded, "step": step})
            m.wait()


def resume(directory: str) -> None:
    warnings.simplefilter("ignore")
    specs = SPECS[os.environ.get("LIKE", "same")]
    like = {n: jax.ShapeDtypeStruct((8, 16), np.float32, sharding=NamedSharding(mesh(), specs[n])) for n in ("w", "u")}
    with manager(directory) as m:
        for attempt in range(int(os.environ.get("TRIES", "1"))):
            latest = m.latest_step()
            if attempt == 0 and (gone := os.environ.get(f"GONE_{jax.process_index()}")):
                for path in gone.split(","):
                    shutil.rmtree(path)
            try:
                if at := os.environ.get("AT"):  # one leaf only
                    leaf = m.load(like[at], at=at)
                    exact = all(
                        np.array_equal(np.asarray(s.data), values(latest, at)[s.index]) for s in leaf.addressable_shards
                    )
                    print(f"TRY {attempt} latest={latest} LOADED {at} of {latest} {exact}", flush=True)
                    return
                out = m.load({**like, "step": 0})
            except eqxckpt.CheckpointError as e:
                message = str(e).replace("\n", " | ")
                print(f"TRY {attempt} latest={latest} RAISED {type(e).__name__}: {message}", flush=True)
                continue
            exact = all(
                np.array_equal(np.asarray(shard.data), values(out["step"], n)[shard.index])
                for n in ("w", "u")
                for shard in out[n].addressable_shards
            )
            print(f"TRY {attempt} latest={latest} LOADED {out['step']} {exact}", flush=True)
            return


if __name__ == "__main__":
    run_scenarios({"save": save, "resume": resume}, devices=2)
