"""Scanned against per-layer T5: compile time and time per generated token, by depth.

For each depth (6, 12 and 24 encoder and as many decoder blocks by default) and each
layout (per-layer: a list of blocks, unrolled when traced; scanned: ``scan_layers=True``,
one stacked block run with `jax.lax.scan`), a fresh Python process builds a random T5
of t5-small's sizes (vocabulary 32128, d_model 512, 8 heads of 64, ReLU feed-forward
of 2048, tied output layer) and times, on the default JAX device:

- forward compile: ``.lower(...).compile()`` of the jitted batched forward (one
  64-token input, 16 decoder tokens): tracing, lowering and XLA's compile;
- step compile: the same for `T5.decode_step` (4 rows, a cache of 33 positions),
  the body of `generate`'s loop;
- generate, first call: a greedy `generate` of 32 tokens, which compiles the
  encoder and the whole decoding loop;
- per token: the same call again, its time over 32 tokens, median of 3 calls;
- generate compile: the first call less 32 tokens at that rate.

Each process runs ``--repeats`` times; the table shows medians. Nothing is cached
between processes (no persistent compilation cache).

    python benchmarks/scan_bench.py --layers 6 12 24 --repeats 3
"""

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time

CONFIG = dict(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_heads=8, feed_forward_proj="relu")
INPUT_LENGTH, DECODER_LENGTH, NEW_TOKENS, STEP_ROWS = 64, 16, 32, 4


def measure(layers: int, scan_layers: bool) -> dict:
    """One process's timings (seconds) for a T5 of ``layers`` blocks per stack."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from eqxckpt import t5

    config = t5.T5Config(**CONFIG, num_layers=layers)
    model = t5.T5(config, key=jax.random.key(0), scan_layers=scan_layers)
    ids = jax.random.randint(jax.random.key(1), (1, INPUT_LENGTH), 2, config.vocab_size)
    decoder_ids = jnp.zeros((1, DECODER_LENGTH), jnp.int32)
    jax.block_until_ready(eqx.filter(model, eqx.is_array))

    def compile_seconds(fn, *args) -> float:
        jax.clear_caches()
        start = time.perf_counter()
        eqx.filter_jit(fn).lower(*args).compile()
        return time.perf_counter() - start

    forward = compile_seconds(lambda m, i, d: jax.vmap(m)(i, d), model, ids, decoder_ids)
    memory = jax.vmap(model.encode)(jnp.repeat(ids, STEP_ROWS, axis=0))
    cross = jax.vmap(model.cross_cache)(memory)
    cache = jax.tree.map(lambda x: jnp.broadcast_to(x, (STEP_ROWS, *x.shape)), model.init_cache(1 + NEW_TOKENS))
    tokens = jnp.zeros(STEP_ROWS, jnp.int32)
    step = compile_seconds(lambda m, *a: m.decode_step(*a), model, tokens, jnp.int32(0), cache, cross)

    def generate() -> float:
        start = time.perf_counter()
        out = t5.generate(model, ids, max_new_tokens=NEW_TOKENS, eos_token_id=None)
        out.sequences.block_until_ready()
        assert out.sequences.shape == (1, 1 + NEW_TOKENS)
        return time.perf_counter() - start

    jax.clear_caches()
    first = generate()
    per_token = statistics.median(generate() / NEW_TOKENS for _ in range(3))
    return {
        "forward_compile": forward,
        "step_compile": step,
        "generate_first": first,
        "generate_compile": first - NEW_TOKENS * per_token,
        "per_token": per_token,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[6, 12, 24])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results-scan.json"))
    parser.add_argument("--worker", nargs=2, metavar=("LAYERS", "LAYOUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:  # one measurement, in this fresh process
        print(json.dumps(measure(int(args.worker[0]), args.worker[1] == "scanned")))
        return

    rows = []
    columns = ("forward compile", "step compile", "generate 1st", "generate compile", "per token")
    print(f"{'layers':>6} {'layout':9} " + " ".join(f"{c:>16}" for c in columns))
    for layers in args.layers:
        for layout in ("per-layer", "scanned"):
            runs = []
            for _ in range(args.repeats):
                worker = [sys.executable, __file__, "--worker", str(layers), layout]
                runs.append(json.loads(subprocess.run(worker, capture_output=True, text=True, check=True).stdout))
            median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
            rows.append({"layers": layers, "layout": layout, "median_s": median, "runs_s": runs})
            seconds = [median[key] for key in ("forward_compile", "step_compile", "generate_first", "generate_compile")]
            print(
                f"{layers:6} {layout:9} "
                + " ".join(f"{t:15.2f}s" for t in seconds)
                + f" {median['per_token'] * 1e3:13.2f} ms",
                flush=True,
            )
    for layout in ("per-layer", "scanned"):
        ends = [row["median_s"] for row in rows if row["layout"] == layout]
        growth = {key: ends[-1][key] / ends[0][key] for key in ("forward_compile", "generate_compile", "per_token")}
        print(
            f"{layout}: {args.layers[0]} -> {args.layers[-1]} layers: forward compile "
            f"{growth['forward_compile']:.2f}x, generate compile {growth['generate_compile']:.2f}x, "
            f"per token {growth['per_token']:.2f}x"
        )
    import jax

    result = {"config": CONFIG, "repeats": args.repeats, "rows": rows, "devices": str(jax.devices())}
    pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
