"""T5 decoding: time per generated token, with the key/value cache and without.

For each search (greedy, 4 beams) and each length P (16 and 256 by default),
`eqxckpt.t5.generate` produces exactly P tokens (no EOS) for one input of 32
tokens, and the time per token is the call's time over P, after a compiling
call of the same shapes. "cache" is the default decoding; "recompute" is
``use_cache=False``: the whole decoder prefix again at every step, as a model
without a cache must. Both run in this one process, on a T5 with t5-small's
vocabulary (32128) and smaller layers, so the recompute finishes in minutes
on two cores. Medians of --repeats.

    python benchmarks/decode_bench.py --lengths 16 256 --repeats 3
"""

import argparse
import json
import pathlib
import statistics
import time

CONFIG = dict(
    vocab_size=32128,
    d_model=256,
    d_kv=64,
    d_ff=1024,
    num_layers=4,
    num_heads=4,
    feed_forward_proj="gated-gelu",
    tie_word_embeddings=False,
)


def per_token(model, input_ids, length: int, beams: int, use_cache: bool, repeats: int) -> float:
    """Median seconds per generated token over ``repeats`` calls of ``length`` tokens."""
    from eqxckpt import t5

    def call() -> None:
        out = t5.generate(
            model, input_ids, max_new_tokens=length, num_beams=beams, eos_token_id=None, use_cache=use_cache
        )
        out.sequences.block_until_ready()
        assert out.sequences.shape[1] == 1 + length

    call()  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) / length)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results-decode.json"))
    args = parser.parse_args()

    import jax

    from eqxckpt import t5

    model = t5.T5(t5.T5Config(**CONFIG), key=jax.random.key(0))
    input_ids = jax.random.randint(jax.random.key(1), (1, 32), 2, CONFIG["vocab_size"])
    rows = []
    for search, beams in (("greedy", 1), ("4 beams", 4)):
        for decoding, use_cache in (("cache", True), ("recompute", False)):
            times = {n: per_token(model, input_ids, n, beams, use_cache, args.repeats) for n in args.lengths}
            first, last = args.lengths[0], args.lengths[-1]
            rows.append(
                {
                    "search": search,
                    "decoding": decoding,
                    "ms_per_token": {str(n): round(t * 1e3, 3) for n, t in times.items()},
                    "growth": round(times[last] / times[first], 2),
                }
            )
            print(
                f"{search:8} {decoding:9} "
                + "  ".join(f"P={n}: {t * 1e3:7.2f} ms/token" for n, t in times.items())
                + f"  growth {first}->{last}: {times[last] / times[first]:.2f}x",
                flush=True,
            )
    result = {
        "config": CONFIG,
        "input_length": 32,
        "lengths": args.lengths,
        "rows": rows,
        "devices": str(jax.devices()),
    }
    pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
