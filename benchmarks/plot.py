"""Plots of the benchmark results for the docs' benchmark page.

Reads the JSON that `bench.py --json` and `decode_bench.py` write and draws,
for each workload, every library's median time per operation as a ratio to
raw file I/O (lower is better), and the decoding times per token.

    python benchmarks/plot.py --bench benchmarks/results-2cpu.json \
        --decode benchmarks/results-decode.json --out docs/img
"""

import argparse
import json
import pathlib
import statistics

OPERATIONS = ("save", "restore", "params")
LABELS = {"save": "durable save", "restore": "full restore", "params": "params-only restore"}


def ratios(part: dict) -> dict[str, dict[str, float]]:
    """``{library: {operation: median seconds / raw's median seconds}}``."""
    raw = {op: statistics.median(run["seconds"] for run in runs) for op in OPERATIONS if (runs := part["raw"].get(op))}
    return {
        library: {
            op: statistics.median(run["seconds"] for run in ops[op]) / raw[op]
            for op in raw
            if ops.get(op)  # an operation a library does not have (Orbax has no partial restore) is empty
        }
        for library, ops in part.items()
        if library != "raw" and any(ops.get(op) for op in OPERATIONS)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = pathlib.Path(__file__).parent
    parser.add_argument("--bench", default=str(here / "results-2cpu.json"))
    parser.add_argument("--decode", default=str(here / "results-decode.json"))
    parser.add_argument("--out", default=str(here.parent / "docs" / "img"))
    args = parser.parse_args()

    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bench = json.loads(pathlib.Path(args.bench).read_text())
    titles = {
        "transformer": f"{bench['args']['mib']:.0f} MiB model + adam state",
        "many": f"{bench['args']['many_leaves']} leaves of 1-64 KiB",
    }
    plt.rcParams.update({"font.size": 12})
    figure, axes = plt.subplots(len(titles), 1, figsize=(8, 9), sharey=False)
    for axis, (part, title) in zip(axes, titles.items()):
        table = ratios(bench[part])
        width = 0.8 / len(table)
        for i, (library, values) in enumerate(sorted(table.items())):
            xs = [OPERATIONS.index(op) + i * width for op in values]
            axis.bar(xs, list(values.values()), width, label=library)
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_xticks([j + 0.4 - width / 2 for j in range(len(OPERATIONS))], [LABELS[op] for op in OPERATIONS])
        axis.set_title(title)
        axis.set_ylabel("time / raw file I/O (lower is better)")
        axis.legend(fontsize=8)
    figure.suptitle(f"eqxckpt and peers, same run\n{bench['machine']}", fontsize=11)
    figure.tight_layout()
    figure.savefig(out / "benchmarks.png", dpi=110)
    print(f"wrote {out / 'benchmarks.png'}")

    decode = json.loads(pathlib.Path(args.decode).read_text())
    figure, axis = plt.subplots(figsize=(6, 4))
    lengths = [str(n) for n in decode["lengths"]]
    for row in decode["rows"]:
        axis.plot(
            [int(n) for n in lengths],
            [row["ms_per_token"][n] for n in lengths],
            marker="o",
            label=f"{row['search']}, {row['decoding']}",
        )
    axis.set_xlabel("tokens generated (prefix length)")
    axis.set_ylabel("ms per token")
    axis.set_yscale("log")
    axis.set_yticks([1, 2, 5, 10, 20, 50, 100, 200])
    axis.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    axis.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axis.set_title("T5 decoding: cache vs recompute")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out / "decoding.png", dpi=110)
    print(f"wrote {out / 'decoding.png'}")


if __name__ == "__main__":
    main()
