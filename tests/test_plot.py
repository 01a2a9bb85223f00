"""The docs' benchmark plots (`benchmarks/plot.py`) and the README's figures come from the
tables the benchmark page shows, and no legend hides a point."""

import importlib.util
import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).parent.parent
TABLES = ROOT / "benchmarks" / "README.md"
IMAGES = ROOT / "docs" / "img"


def plot_module():
    spec = importlib.util.spec_from_file_location("benchmark_plot", ROOT / "benchmarks" / "plot.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


plot = plot_module()


def test_the_tables_read_whole_with_their_commits_and_dates():
    text = TABLES.read_text()
    sizes = plot.size_table(text)
    assert len(sizes.sizes) >= 3 and re.fullmatch(r"[0-9a-f]{7,40}", sizes.run.after)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", sizes.run.date) and "cores" in sizes.run.machine
    for _, rows, _ in plot.SIZE_PLOTS.values():
        for _, row in rows:  # every size has an "after" figure, with its Orbax ratio
            assert set(sizes.ratios(row, "after")) == set(sizes.sizes), row
    assert sizes.ratios("durable save", "after")["3.4 GiB"] == (1.05, 0.27)  # a cell read as the page shows it
    leaves, commits = plot.leaves_table(text)
    assert {kind for _, kind in leaves} == {"save", "restore"}
    assert set(commits) == {"before", "after", "date", "machine"} and commits["before"] == "ad4baf3"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", commits["date"]) and "cores" in commits["machine"]
    assert leaves[(100_000, "save")]["before"] == (2.78, "ad4baf3")  # a cell read as the page shows it
    decoding, label = plot.decoding_table(text)
    assert re.search(r"at [0-9a-f]{7}; \d{4}-\d\d-\d\d", label)
    # The page's T5 block is the run in results-decode.json.
    run = json.loads((ROOT / "benchmarks" / "results-decode.json").read_text())
    assert decoding == {
        f"{row['search']}, {row['decoding']}": {int(n): round(ms, 2) for n, ms in row["ms_per_token"].items()}
        for row in run["rows"]
    }


def test_the_committed_plots_were_drawn_from_todays_tables():
    """Each PNG records a digest of the figures it shows; editing a table without
    `make plots` leaves a plot of an older run, which this catches."""
    expected = plot.expected_digests(TABLES.read_text())
    for name, digest in expected.items():
        assert plot.png_text(IMAGES / name).get(plot.DIGEST_KEY) == digest, f"{name} is stale: run `make plots`"
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert set(re.findall(r"\(img/([\w-]+\.png)\)", page)) == set(expected)  # the page shows every plot
    assert '--8<-- "benchmarks/README.md' in page  # and the tables they are drawn from
    makefile = (ROOT / "Makefile").read_text()
    assert "$(BIN)/python benchmarks/plot.py" in makefile.split("\nplots:", 1)[1].split("\n\n", 1)[0]


def test_the_readme_figures_are_the_tables():
    """The README's benchmark summary is `plot.py --headline`, from the same table."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert " ".join(plot.headline(TABLES.read_text()).split()) in readme


def test_plots_draw_with_every_point_visible_and_no_legend_on_a_plot(tmp_path):
    pytest.importorskip("matplotlib")
    written = plot.draw(tmp_path, TABLES.read_text())  # draw() refuses a hidden point or a covering legend
    assert sorted(p.name for p in written) == sorted(plot.expected_digests(TABLES.read_text()))
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots()
    axis.plot([1, 2], [1, 2], "o-", label="data")
    axis.legend(loc="upper left")
    figure.canvas.draw()
    with pytest.raises(AssertionError, match="legend covers"):
        plot.nothing_hidden(figure, "inside.png")
    axis.set_ylim(0, 1.5)
    axis.get_legend().remove()
    with pytest.raises(AssertionError, match="outside the axes"):
        plot.nothing_hidden(figure, "clipped.png")
    plt.close(figure)
