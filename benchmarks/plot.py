"""Plots of the benchmark results for the docs' benchmark page: one per question.

Reads the JSON that `bench.py --json` and `decode_bench.py` write and draws,
for each question, every library's median time as a ratio to raw file I/O
(lower is better): saving, a full restore and a params-only restore (warm
and cold page cache) against the state's size; many small leaves; and the T5
decoding time per token.

    python benchmarks/plot.py --bench benchmarks/results-2cpu.json \
        --decode benchmarks/results-decode.json --out docs/img
"""

import argparse
import json
import pathlib
import statistics

# One plot per question: its file, title, the operations drawn (solid, then dashed) and the target.
QUESTIONS = {
    "save.png": ("Saving (durable: fsync'd)", {"save": "save"}, 1.1),
    "restore.png": ("Restoring everything", {"restore warm": "warm cache", "restore cold": "cold cache"}, 1.1),
    "params.png": (
        'Restoring the parameters only (at="model")',
        {"params warm": "warm cache", "params cold": "cold cache"},
        1.2,
    ),
}
STYLE = {"eqxckpt": ("tab:blue", "o"), "orbax": ("tab:orange", "s")}
LINES = ("-", "--")
SIZE = (7.5, 4.2)  # inches at 100 dpi: the page's full width, labels at reading size


def ratio(part: dict, library: str, op: str) -> float | None:
    """Median seconds of ``library`` doing ``op`` over raw's, or None if it did not run."""
    runs, raw = part.get(library, {}).get(op), part["raw"].get(op)
    if not runs or not raw:
        return None
    return statistics.median(r["seconds"] for r in runs) / statistics.median(r["seconds"] for r in raw)


def draw(axis, parts: dict, ops: dict, *, integer: bool) -> None:
    """Ratios to raw of every library, for each operation (solid, then dashed), along the x values."""
    xs = sorted(parts, key=float)
    for op, linestyle in zip(ops, LINES):
        for library, (colour, marker) in STYLE.items():
            points = [(float(x), r) for x in xs if (r := ratio(parts[x], library, op)) is not None]
            if points:
                label = f"{library}, {ops[op]}" if len(ops) > 1 else library
                axis.plot(*zip(*points), marker=marker, color=colour, linestyle=linestyle, label=label)
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_xscale("log")
    axis.set_xticks([float(x) for x in xs], [f"{int(float(x)):,}" if integer else x for x in xs])
    axis.minorticks_off()
    axis.set_ylim(bottom=0)
    axis.set_ylabel("time / raw file I/O (lower is better)")
    axis.grid(axis="y", alpha=0.3)


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
    plt.rcParams.update({"font.size": 12})
    machine = bench["machine"]
    for name, (title, ops, target) in QUESTIONS.items():
        figure, axis = plt.subplots(figsize=SIZE)
        draw(axis, bench["sizes"], ops, integer=False)
        axis.axhline(target, color="tab:green", linewidth=1, linestyle=":", label=f"target {target}x")
        axis.set_xlabel("model + optimizer state (MiB)")
        axis.set_title(f"{title}\n{machine}", fontsize=11)
        axis.legend(fontsize=10, loc="best")
        figure.tight_layout()
        figure.savefig(out / name, dpi=100)
        plt.close(figure)
        print(f"wrote {out / name}")
    # Many small leaves: Orbax runs only up to --orbax-max-leaves (10,000): at 100,000 its save
    # alone would take minutes per repeat (17 s at 10,000).
    figure, axis = plt.subplots(figsize=SIZE)
    draw(axis, bench.get("leaves", {}), {"save": "save", "restore warm": "restore"}, integer=True)
    axis.set_yscale("log")
    axis.set_ylim(0.8, 150)
    axis.set_yticks([1, 2, 5, 10, 20, 50, 100], ["1", "2", "5", "10", "20", "50", "100"])
    axis.set_xlabel("leaves of 1-64 KiB (float32)")
    axis.set_title(f"Many small leaves (Orbax run at 10,000 only)\n{machine}", fontsize=11)
    axis.legend(fontsize=10, loc="best")
    figure.tight_layout()
    figure.savefig(out / "leaves.png", dpi=100)
    plt.close(figure)
    print(f"wrote {out / 'leaves.png'}")

    decode = json.loads(pathlib.Path(args.decode).read_text())
    figure, axis = plt.subplots(figsize=SIZE)
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
    axis.legend(fontsize=10)
    figure.tight_layout()
    figure.savefig(out / "decoding.png", dpi=100)
    print(f"wrote {out / 'decoding.png'}")


if __name__ == "__main__":
    main()
