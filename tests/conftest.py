import os
import pathlib
import subprocess
import sys
from typing import TYPE_CHECKING

# The suite compiles hundreds of small XLA programs (T5 forward passes and generation
# loops, collectives of multi-process restores), and LLVM's optimisation of the machine
# code is most of each compile; the programs are tiny, so optimising them buys nothing.
# Set before JAX is imported, and inherited by every process the tests start. XLA's own
# passes still run: the numbers computed are checked as before.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

import pytest

if TYPE_CHECKING:
    import collections

    from eqxckpt._storage._disk import LocalStorage

# The helpers, one module a concern, named here for the tests (`from conftest import ...`);
# the fixtures among them are registered by being here.
from _servers import (  # noqa: E402
    BUCKET as BUCKET,
    CREDENTIALS as CREDENTIALS,
    GCS_ENVIRONMENT as GCS_ENVIRONMENT,
    CountingProxy as CountingProxy,
    ObjectStore as ObjectStore,
    PausableProxy as PausableProxy,
    gcs as gcs,
    s3 as s3,
    s3_spec as s3_spec,
    store as store,
)
from _trees import (  # noqa: E402
    assert_trees_equal as assert_trees_equal,
    crafted_manifest as crafted_manifest,
    manifest_doc as manifest_doc,
)
from _workers import (  # noqa: E402
    WORKERS as WORKERS,
    WorkerFailed as WorkerFailed,
    end_workers as end_workers,
    kill_when as kill_when,
    launch as launch,
    on_devices as on_devices,
    release_fifo as release_fifo,
    returns_within as returns_within,
    run_cli as run_cli,
    start_workers as start_workers,
)

# The scripts tests start in other processes (and whose helpers some tests import).
sys.path.insert(0, str(WORKERS))


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="run the long fault-injection and fuzz loops")


def pytest_collection_modifyitems(config, items):
    """Marks from what a test needs: ``s3``/``gcs`` from the server fixtures it uses;
    ``slow`` for anything that starts servers, worker processes or TensorFlow (so
    ``pytest -m "not slow"`` runs the in-process tests in a few minutes); and tests
    that need TensorFlow are skipped, saying so, where it is not installed."""
    import importlib.util

    no_tf = importlib.util.find_spec("tensorflow") is None
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & {"s3", "store"}:
            item.add_marker(pytest.mark.s3)
        if fixtures & {"gcs", "store"}:
            item.add_marker(pytest.mark.gcs)
        if any(item.get_closest_marker(name) for name in ("s3", "gcs", "multiprocess", "tf")):
            item.add_marker(pytest.mark.slow)
        if no_tf and item.get_closest_marker("tf"):
            item.add_marker(pytest.mark.skip(reason="needs TensorFlow: pip install -e '.[tf]'"))


def pyright_path() -> str:
    """The pyright of the test environment: a test dependency (the `test` extra), which
    `make test` also runs, so a missing one is a broken environment, not a skip."""
    found = pathlib.Path(sys.executable).parent / "pyright"
    assert found.exists(), f"pyright is missing from {found.parent}: pip install -e '.[test]'"
    return str(found)


def save_tf_tensors(directory, tensors: dict, step: int = 7) -> None:
    """``tensors`` ({name: numpy array}) as a TensorFlow checkpoint written by TensorFlow
    itself: ``directory/model.ckpt-<step>`` and its ``checkpoint`` file."""
    import tensorflow as tf

    directory.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    tf.raw_ops.SaveV2(
        prefix=str(directory / f"model.ckpt-{step}"),
        tensor_names=names,
        shape_and_slices=[""] * len(names),
        tensors=[tf.constant(tensors[n]) for n in names],
    )
    (directory / "checkpoint").write_text(f'model_checkpoint_path: "model.ckpt-{step}"\n')


def untracked() -> list[str]:
    """What git sees in the repository besides its tracked files (nothing, if not a git checkout)."""
    done = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all", "--ignored"],
        cwd=pathlib.Path(__file__).parent.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return sorted(line for line in done.stdout.splitlines() if ".venv" not in line and "__pycache__" not in line)


def counting_storage(path: pathlib.Path) -> "tuple[LocalStorage, collections.Counter]":
    """A checkpoint's local storage whose chunk files count their reads, by key: the
    backend's own seam (`Storage.chunk_files`), the real files read underneath."""
    import collections

    from eqxckpt._storage._disk import LocalStorage
    from eqxckpt._storage._disk_chunks import LocalChunkFiles

    reads: collections.Counter = collections.Counter()

    class CountingFiles(LocalChunkFiles):
        def _read_ranges(self, key: str, ranges, size: int) -> None:
            reads[key] += 1  # every read of a local chunk file, in one range or a slab at a time
            super()._read_ranges(key, ranges, size)

    class CountingStorage(LocalStorage):
        def chunk_files(self) -> LocalChunkFiles:
            return CountingFiles(str(self.path))

    return CountingStorage.at(path), reads
