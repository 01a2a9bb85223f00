"""The docs' benchmark page's plots, drawn from the tables that page shows.

    python benchmarks/plot.py          # or: make plots

Every plot is drawn from a table in `benchmarks/README.md` (which the page
includes), so a plot can never show an older run than its table: the state
sizes from "Before and after" (eqxckpt's time over raw file I/O's and over
Orbax's), many small leaves from "A manifest for many leaves", T5 decoding
from its block. Each plot is labelled with the commits and the date its table states,
and keeps its legend outside the axes, where it hides no point. Each PNG also
records a digest of the figures it was drawn from, which the tests compare
with today's tables (a table edited without `make plots` fails them).

`python benchmarks/plot.py --headline` prints the README's summary sentence,
taken from the same table.
"""

import argparse
import hashlib
import json
import pathlib
import re
import struct
import zlib
from dataclasses import dataclass

HERE = pathlib.Path(__file__).parent
README = HERE / "README.md"
# The table a plot is drawn from, and the section of benchmarks/README.md holding it.
IO_CORE = "## The I/O core"
SIZES_HEADER = "eqxckpt / raw (/ Orbax)"  # its first such table: by state size, before and after
MANY_LEAVES = "## A manifest for many leaves"  # the section of the many-leaves plot's table
LEAVES_HEADER = ("", "| before (")  # the many-leaves table: `| | before (ad4baf3) | after | limit |`
DECODING = "## T5 decoding"
HEADLINE_SIZE = "913 MiB"  # the size the README's summary quotes
DIGEST_KEY = "eqxckpt-table-digest"  # the PNG text chunk naming what a plot was drawn from
# Each plot: its rows of the size table, as (label, row name), and the limit over raw.
SIZE_PLOTS = {
    "save.png": ("Saving (durable: fsync'd)", [("", "durable save")], 1.1),
    "restore.png": (
        "Restoring everything",
        [("warm page cache", "full restore, warm"), ("cold page cache", "full restore, cold")],
        1.1,
    ),
    "params.png": (
        'Restoring the parameters only (at="model")',
        [("warm page cache", "params, warm"), ("cold page cache", "params, cold")],
        1.2,
    ),
}
NUMBER = r"(\d+(?:\.\d+)?)"


@dataclass(frozen=True)
class Run:
    """Where a table's figures were measured: the commits compared, the date and the machine."""

    before: str
    after: str
    date: str
    machine: str

    def label(self) -> str:
        return f"{self.machine}; before = {self.before}, after = {self.after}; {self.date}"


@dataclass(frozen=True)
class SizeTable:
    """The "Before and after" table: per row and (size, "before" | "after"), eqxckpt's time
    over raw's and over Orbax's; Orbax over raw is their quotient."""

    sizes: list[str]
    cells: dict[str, dict[tuple[str, str], str]]
    run: Run

    def ratios(self, row: str, when: str) -> dict[str, tuple[float, float]]:
        """``{size: (eqxckpt / raw, eqxckpt / Orbax)}`` of ``row`` in the ``when`` run."""
        found = {}
        for (size, run), cell in self.cells[row].items():
            if run == when:
                match = re.fullmatch(rf"{NUMBER}x \({NUMBER}x\)", cell)
                if match is None:
                    raise ValueError(f"{row!r} at {size} {when}: {cell!r} is not 'AAx (BBx)'")
                found[size] = (float(match[1]), float(match[2]))
        return found


def section(text: str, heading: str) -> str:
    """The text under the ``## `` heading that starts with ``heading``, up to the next one."""
    start = text.index(f"\n{heading}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def cells(line: str) -> list[str]:
    return [cell.strip().replace("**", "") for cell in line.strip().strip("|").split("|")]


def table(text: str, first: str, contains: str = "") -> tuple[list[str], list[list[str]]]:
    """The first Markdown table in ``text`` whose header's first cell is ``first`` (and which
    holds ``contains``): its header cells and rows."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|") and cells(line)[0] == first and contains in line:
            rows = []
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                rows.append(cells(row))
            return cells(line), rows
    raise LookupError(f"no table headed {first!r} in benchmarks/README.md")


def found(pattern: str, text: str) -> re.Match:
    match = re.search(pattern, " ".join(text.split()))
    if match is None:
        raise LookupError(f"benchmarks/README.md no longer says {pattern!r}, which labels a plot")
    return match


def io_core_run(text: str) -> Run:
    commits = found(r"before = (\w+), after = (\w+), (\d{4}-\d\d-\d\d)", text)
    machine = found(r"this VM: (x86_64, \d+ cores, \d+ GiB)", text)[1]
    return Run(before=commits[1], after=commits[2], date=commits[3], machine=machine)


def size_table(text: str) -> SizeTable:
    """The "Before and after" table of ``benchmarks/README.md``'s I/O core section."""
    part = section(text, IO_CORE)
    header, rows = table(part, SIZES_HEADER)
    columns, size = [], None
    for name in header[1:]:  # "75 MiB before", "after", ..., "3.4 GiB after"
        *words, when = name.split()
        size = " ".join(words) or size
        if size is None or when not in ("before", "after"):
            raise ValueError(f"unexpected column {name!r} in the size table")
        columns.append((size, when))
    sizes = list(dict.fromkeys(s for s, _ in columns))
    return SizeTable(sizes, {row[0]: dict(zip(columns, row[1:], strict=True)) for row in rows}, io_core_run(part))


def mib(size: str) -> float:
    number, unit = size.split()
    return float(number) * {"MiB": 1, "GiB": 1024}[unit]


def leaves_table(text: str) -> tuple[dict[tuple[int, str], dict[str, tuple[float, str]]], dict[str, str]]:
    """Many small leaves: ``{(leaves, "save" | "restore"): {"before" | "after": (x raw, commit)}}``
    with the issue's limit under "limit"; and the commits the table's columns name, the
    date and the machine (its section's, "A manifest for many leaves")."""
    part = section(text, MANY_LEAVES)
    header, rows = table(part, *LEAVES_HEADER)
    run = io_core_run(part)
    before = found(r"before \((\w+)\)", header[1])[1]
    figures = {}
    for row in rows:
        match = re.fullmatch(r"([\d,]+) leaves(?: \([^)]*\))?: (save|restore) / raw", row[0])
        if match is None:
            continue  # verify and memory rows: not ratios to raw
        values = {}
        for when, cell, commit in (("before", row[1], before), ("after", row[2], run.after)):
            at = re.search(r"\bat (\w+)\)", cell.split(";")[0])  # "3.96x (13.2 s vs 3.34 s, at 1fdb509)"
            values[when] = (float(found(rf"^{NUMBER}x", cell)[1]), at[1] if at else commit)
        values["limit"] = (float(found(rf"{NUMBER}x", row[3])[1]), "")
        figures[(int(match[1].replace(",", "")), match[2])] = values
    return figures, {"before": before, "after": run.after, "date": run.date, "machine": run.machine}


def decoding_table(text: str) -> tuple[dict[str, dict[int, float]], str]:
    """T5 decoding's block: ``{"greedy, cache": {16: ms per token, 256: ...}, ...}`` and its label."""
    part = section(text, DECODING)
    rows = {}
    for search, decoding, rest in re.findall(r"^(greedy|\d+ beams)\s+(cache|recompute)\s+(P=.*)$", part, re.M):
        rows[f"{search}, {decoding}"] = {int(n): float(t) for n, t in re.findall(rf"P=(\d+):\s+{NUMBER} ms", rest)}
    measured = found(r"Measured (\d{4}-\d\d-\d\d) at (\w+) on the development VM \((\d+ cores, \w+)\)", part)
    return rows, f"{measured[3]}; at {measured[2]}; {measured[1]}"


def headline(text: str) -> str:
    """The README's summary sentence, from the size table's "after" run at ``HEADLINE_SIZE``."""
    sizes = size_table(text)

    def ratio(row: str) -> str:
        raw, orbax = sizes.ratios(row, "after")[HEADLINE_SIZE]
        return f"{raw:.2f}x raw and {orbax:.2f}x Orbax"

    cell = sizes.cells
    return (
        f"For a {HEADLINE_SIZE} model + adam state on a 2-core VM (after = {sizes.run.after}): "
        f"a durable save at {ratio('durable save')}, a warm restore at {ratio('full restore, warm')} "
        f"peaking at {cell['restore peak RSS / restored bytes'][(HEADLINE_SIZE, 'after')]} the restored bytes, "
        f"a params-only restore at {ratio('params, warm')}, and an async save that blocks the caller "
        f"for {cell['async save, caller blocked'][(HEADLINE_SIZE, 'after')]}."
    )


def digest(figures: object) -> str:
    """What a plot was drawn from, in 16 hex digits: its figures and labels."""
    return hashlib.sha256(json.dumps(figures, sort_keys=True, default=str).encode()).hexdigest()[:16]


def expected_digests(text: str) -> dict[str, str]:
    """Each plot's file name and the digest of the figures today's tables give it."""
    sizes = size_table(text)
    digests = {}
    for name, (_, rows, target) in SIZE_PLOTS.items():
        digests[name] = digest(
            [sizes.run, target] + [sizes.ratios(row, w) for _, row in rows for w in ("before", "after")]
        )
    digests["leaves.png"] = digest([sorted(leaves_table(text)[0].items()), leaves_table(text)[1]])
    digests["decoding.png"] = digest(decoding_table(text))
    return digests


def png_text(path: pathlib.Path) -> dict[str, str]:
    """A PNG's ``tEXt`` chunks (where matplotlib writes ``metadata=``), read with the standard library."""
    data, found_text, at = path.read_bytes(), {}, 8
    while at < len(data):
        (length,), kind = struct.unpack(">I", data[at : at + 4]), data[at + 4 : at + 8]
        body = data[at + 8 : at + 8 + length]
        if kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            found_text[key.decode("latin-1")] = value.decode("latin-1")
        elif kind == b"zTXt":
            key, _, value = body.partition(b"\0")
            found_text[key.decode("latin-1")] = zlib.decompress(value[1:]).decode("latin-1")
        at += 12 + length
    return found_text


def nothing_hidden(figure, name: str) -> None:
    """Raise if a legend overlaps a plot, or a point or bar lies outside its axes' limits."""
    plots = figure.get_axes()
    legends = list(figure.legends) + [a.get_legend() for a in plots if a.get_legend() is not None]
    for legend in legends:
        for axis in plots:
            if legend.get_window_extent().overlaps(axis.get_window_extent()):
                raise AssertionError(f"{name}: a legend covers part of a plot")
    for axis in plots:
        (x0, x1), (y0, y1) = sorted(axis.get_xlim()), sorted(axis.get_ylim())
        points = [xy for line in axis.lines if line.get_marker() not in (None, "None", "") for xy in line.get_xydata()]
        points += [(bar.get_x() + bar.get_width() / 2, bar.get_height()) for bar in axis.patches]
        outside = [(x, y) for x, y in points if not (x0 <= x <= x1 and y0 <= y <= y1)]
        if outside:
            raise AssertionError(f"{name}: points outside the axes: {outside}")


def draw(out: pathlib.Path, text: str) -> list[pathlib.Path]:
    """Every plot of the page, from ``text`` (benchmarks/README.md), into ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    plt.rcParams.update({"font.size": 12, "legend.fontsize": 10, "axes.titlesize": 12})
    digests = expected_digests(text)
    written = []

    def save(figure, name: str) -> None:
        path = out / name
        figure.canvas.draw()  # lays the figure out, so that what it shows can be checked
        nothing_hidden(figure, name)
        figure.savefig(path, dpi=100, metadata={DIGEST_KEY: digests[name]})
        plt.close(figure)
        written.append(path)
        print(f"wrote {path}")

    def log_ratio_axis(axis, values: list[float]) -> None:
        axis.set_yscale("log")
        axis.set_ylim(min(values + [1.0]) / 1.3, max(values) * 1.3)
        axis.yaxis.set_major_locator(matplotlib.ticker.FixedLocator([0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50]))
        axis.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
        axis.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.grid(axis="y", alpha=0.3)

    sizes = size_table(text)
    run = sizes.run
    xs = {size: mib(size) for size in sizes.sizes}
    for name, (title, rows, target) in SIZE_PLOTS.items():
        figure, axes = plt.subplots(
            len(rows), 1, figsize=(7.5, 2.2 + 2.3 * len(rows)), sharex=True, squeeze=False, layout="constrained"
        )
        values = [
            v
            for _, row in rows
            for w in ("before", "after")
            for r in sizes.ratios(row, w).values()
            for v in (r[0], r[0] / r[1])
        ]
        for axis, (label, row) in zip(axes[:, 0], rows):
            after, before = sizes.ratios(row, "after"), sizes.ratios(row, "before")
            lines = [  # (ratios by size, which ratio, style, colour, opacity, label)
                (after, lambda r: r[0] / r[1], "s-", "tab:orange", 1.0, f"Orbax ({run.after} run)"),
                (before, lambda r: r[0], "o--", "tab:blue", 0.45, f"eqxckpt before ({run.before})"),
                (after, lambda r: r[0], "o-", "tab:blue", 1.0, f"eqxckpt after ({run.after})"),
            ]
            for by_size, ratio, style, colour, alpha, label in lines:
                ys = [ratio(r) for r in by_size.values()]
                axis.plot([xs[s] for s in by_size], ys, style, color=colour, alpha=alpha, label=label)
            axis.axhline(target, color="tab:green", linewidth=1.2, linestyle=":", label=f"limit {target}x raw")
            log_ratio_axis(axis, values)
            axis.set_xscale("log")
            axis.set_xticks(list(xs.values()), list(xs))
            axis.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            axis.set_ylabel("time / raw I/O")
            if label:
                axis.set_title(label, fontsize=11, loc="left")
        axes[-1, 0].set_xlabel("model + adam state (lower is better; black line: raw file I/O)")
        figure.suptitle(f"{title}\n{run.label()}", fontsize=11)
        figure.legend(*axes[0, 0].get_legend_handles_labels(), loc="outside lower center", ncol=2)
        save(figure, name)

    # Many small leaves: grouped bars (two leaf counts only), each labelled with its value and,
    # where its table cell says so, the commit it was measured at.
    leaves, commits = leaves_table(text)
    figure, axis = plt.subplots(figsize=(7.5, 4.6), layout="constrained")
    groups = sorted(leaves, key=lambda g: (g[0], g[1] != "save"))
    width = 0.38
    for offset, when, colour in ((-width / 2, "before", "#9ecae1"), (width / 2, "after", "tab:blue")):
        bars = axis.bar(
            [i + offset for i in range(len(groups))],
            [leaves[g][when][0] for g in groups],
            width,
            color=colour,
            label=f"{when} ({commits[when]})",
        )
        labels = [
            f"{value:.2f}x" + ("" if at == commits[when] else f"\nat {at}")
            for value, at in (leaves[g][when] for g in groups)
        ]
        axis.bar_label(bars, labels, fontsize=10, padding=2)
    for i, g in enumerate(groups):
        axis.hlines(
            leaves[g]["limit"][0],
            i - width,
            i + width,
            color="tab:green",
            linestyle=":",
            linewidth=1.5,
            label="limit" if i == 0 else None,
        )
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_xticks(range(len(groups)), [f"{kind}\n{count:,} leaves" for count, kind in groups])
    axis.set_ylim(0, max(v[0] for g in groups for v in leaves[g].values()) * 1.18)
    axis.set_ylabel("time / raw I/O (lower is better)")
    axis.grid(axis="y", alpha=0.3)
    axis.set_title(
        f"Many small leaves (float32, 1-64 KiB; Orbax not in this run)\n{commits['machine']}; {commits['date']}",
        fontsize=11,
    )
    figure.legend(loc="outside lower center", ncol=3)
    save(figure, "leaves.png")

    rows, label = decoding_table(text)
    figure, axis = plt.subplots(figsize=(7.5, 5.4), layout="constrained")
    styles = {"cache": "o-", "recompute": "s--"}
    colours = {"greedy": "tab:blue", "4 beams": "tab:purple"}
    for name, times in rows.items():
        search, decoding = name.split(", ")
        axis.plot(list(times), list(times.values()), styles[decoding], color=colours.get(search), label=name)
        for n, t in times.items():
            axis.annotate(
                f"{t:g}",
                (n, t),
                textcoords="offset points",
                xytext=(6 if n == max(times) else -6, 0),
                ha="left" if n == max(times) else "right",
                va="center",
                fontsize=10,
            )
    lengths = sorted({n for times in rows.values() for n in times})
    axis.set_xscale("log")
    axis.set_xticks(lengths, [str(n) for n in lengths])
    axis.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    axis.set_xlim(lengths[0] / 2, lengths[-1] * 2)
    axis.set_yscale("log")
    axis.yaxis.set_major_locator(matplotlib.ticker.FixedLocator([1, 2, 5, 10, 20, 50, 100, 200]))
    axis.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    axis.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axis.set_xlabel("tokens generated (prefix length)")
    axis.set_ylabel("ms per token")
    axis.grid(axis="y", alpha=0.3)
    axis.set_title(f"T5 decoding: key/value cache vs recomputing the prefix\n{label}", fontsize=11)
    figure.legend(loc="outside lower center", ncol=2)
    save(figure, "decoding.png")
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", default=str(README), help="the Markdown holding the tables")
    parser.add_argument("--out", default=str(HERE.parent / "docs" / "img"))
    parser.add_argument("--headline", action="store_true", help="print the README's summary sentence and stop")
    args = parser.parse_args()
    text = pathlib.Path(args.tables).read_text()
    if args.headline:
        print(headline(text))
        return
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    draw(out, text)


if __name__ == "__main__":
    main()
