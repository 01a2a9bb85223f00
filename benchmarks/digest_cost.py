"""What leaf digests cost: the hash candidates' throughput on this machine, and a
durable save of a ~336 MiB model + adam state with and without its digest pass
(medians of 8 interleaved saves each, same process, after a warm-up).

    .venv/bin/python benchmarks/digest_cost.py
"""

import hashlib
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, __import__("os").path.dirname(__file__))
from workloads import transformer_state  # noqa: E402


def throughput(fn, nbytes: int, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def main() -> None:
    import xxhash

    import eqxckpt
    import eqxckpt._write._save as save_module

    data = np.random.default_rng(0).integers(0, 255, 256 << 20, dtype=np.uint8)
    view = data.data
    print(
        f"xxhash {xxhash.VERSION} xxh3_128: {throughput(lambda: xxhash.xxh3_128(view).digest(), data.nbytes):.1f} GB/s"
    )
    try:
        import blake3

        print(f"blake3 {blake3.__version__}: {throughput(lambda: blake3.blake3(view).digest(), data.nbytes):.1f} GB/s")
    except ImportError:
        print("blake3: not installed")
    print(f"hashlib sha256: {throughput(lambda: hashlib.sha256(view).digest(), data.nbytes, 3):.1f} GB/s")
    print(f"numpy copy (memory bandwidth): {throughput(lambda: data.copy(), data.nbytes):.1f} GB/s")

    state = transformer_state(336)
    real = save_module._digested
    times: dict[str, list[float]] = {"with digests": [], "without": []}
    with tempfile.TemporaryDirectory() as root:
        for i in range(9):  # interleaved, so that the disk's drift falls on both alike
            order = (("with digests", real), ("without", lambda manifest, leaves: manifest))
            for label, digested in order[:: 1 if i % 2 else -1]:  # each first in turn
                save_module._digested = digested
                start = time.perf_counter()
                eqxckpt.save(f"{root}/{label}{i}", state)
                times[label].append(time.perf_counter() - start)
    save_module._digested = real
    rows = {label: statistics.median(found[1:]) for label, found in times.items()}
    print(
        f"durable save, 336 MiB: {rows['with digests']:.3f} s with digests, {rows['without']:.3f} s without "
        f"({rows['with digests'] / rows['without']:.3f}x)"
    )


if __name__ == "__main__":
    main()
