"""Plots of the benchmark results for the docs' benchmark page.

Reads the JSON that `bench.py --json` and `decode_bench.py` write and draws
every library's median time per operation as a ratio to raw file I/O (lower
is better): against the state's size (save, restore and params-only restore,
warm and cold page cache) and against the number of leaves; and the T5
decoding times per token.

    python benchmarks/plot.py --bench benchmarks/results-2cpu.json \
        --decode benchmarks/results-decode.json --out docs/img
"""

import argparse
import json
import pathlib
import statistics

SIZE_OPERATIONS = {
    "save": "durable save",
    "restore warm": "full restore, warm cache",
    "restore cold": "full restore, cold cache",
    "params warm": "params-only restore, warm",
    "params cold": "params-only restore, cold",
}
LEAF_OPERATIONS = {"save": "durable save", "restore warm": "full restore"}
STYLE = {"eqxckpt": ("tab:blue", "o"), "eqxckpt-unpacked": ("tab:gray", "^"), "orbax": ("tab:orange", "s")}


def ratio(part: dict, library: str, op: str) -> float | None:
    """Median seconds of ``library`` doing ``op`` over raw's, or None if it did not run."""
    runs, raw = part.get(library, {}).get(op), part["raw"].get(op)
    if not runs or not raw:
        return None
    return statistics.median(r["seconds"] for r in runs) / statistics.median(r["seconds"] for r in raw)


def sweep(axis, parts: dict, op: str, title: str, xlabel: str, limit: float | None) -> None:
    """Ratios to raw of every library for ``op`` along the sweep's x values."""
    xs = sorted(parts, key=float)
    for library, (colour, marker) in STYLE.items():
        points = [(float(x), r) for x in xs if (r := ratio(parts[x], library, op)) is not None]
        if points:
            axis.plot(*zip(*points), marker=marker, color=colour, label=library)
    axis.axhline(1.0, color="black", linewidth=0.8)
    if limit is not None:
        axis.axhline(limit, color="tab:green", linewidth=0.8, linestyle="--", label=f"target {limit}x")
    axis.set_xscale("log")
    axis.set_xticks([float(x) for x in xs], xs)
    axis.minorticks_off()
    axis.set_title(title, fontsize=11)
    axis.set_xlabel(xlabel)
    axis.set_ylim(bottom=0)


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
    plt.rcParams.update({"font.size": 11})
    limits = {"save": 1.1, "restore warm": 1.1, "restore cold": 1.1, "params warm": 1.2, "params cold": 1.2}
    figure, axes = plt.subplots(2, 3, figsize=(13, 8))
    for axis, (op, title) in zip(axes.flat, SIZE_OPERATIONS.items()):
        sweep(axis, bench["sizes"], op, title, "state size (MiB)", limits[op])
        axis.set_ylabel("time / raw file I/O")
    leaves = bench.get("leaves", {})
    axis = axes.flat[5]
    for op, (linestyle, name) in {"save": ("-", "save"), "restore warm": ("--", "restore")}.items():
        xs = sorted(leaves, key=int)
        for library, (colour, marker) in STYLE.items():
            points = [(int(x), r) for x in xs if (r := ratio(leaves[x], library, op)) is not None]
            if points:
                axis.plot(*zip(*points), marker=marker, color=colour, linestyle=linestyle, label=f"{library} {name}")
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xticks([int(x) for x in leaves], [f"{int(x):,}" for x in leaves])
    axis.minorticks_off()
    axis.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    axis.set_title("many leaves of 1-64 KiB", fontsize=11)
    axis.set_xlabel("leaves")
    for axis in axes.flat:
        axis.legend(fontsize=8)
    figure.suptitle(
        f"time / raw file I/O, lower is better (eqxckpt and Orbax, same run)\n{bench['machine']}", fontsize=11
    )
    figure.tight_layout()
    figure.savefig(out / "benchmarks.png", dpi=100)
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
