"""Run the README's Python examples in order, as a reader pastes them, from a new
directory outside the clone (`make demo` runs this after `examples/demo.py`).

Blocks whose first line says they need TensorFlow run where it is installed; the
object-store block runs where ``AWS_ENDPOINT_URL`` points at an S3 server. Every
other block runs, and each prints a line as it starts, so a slow one is visible.

    python examples/readme.py [--keep]   # --keep: leave the directory it ran in
"""

import importlib.util
import os
import pathlib
import re
import shutil
import sys
import tempfile
import time

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def blocks() -> list[tuple[int, str]]:
    """(line number, code) of each ```python block of the README, in order."""
    text = README.read_text()
    return [
        (text.count("\n", 0, match.start()) + 2, match.group(1))
        for match in re.finditer(r"```python\n(.*?)```", text, flags=re.S)
    ]


def why_not(code: str) -> str | None:
    """Why a block cannot run here (what its first line says it needs), or None."""
    first = code.splitlines()[0] if code else ""
    if first.startswith("# Needs TensorFlow") and importlib.util.find_spec("tensorflow") is None:
        return "needs TensorFlow (pip install -e '.[examples,tf]')"
    if first.startswith("# Needs an S3 server") and "AWS_ENDPOINT_URL" not in os.environ:
        return "needs an S3 server: see the shell lines above it in the README"
    return None


def main(keep: bool = False) -> None:
    work = pathlib.Path(tempfile.mkdtemp(prefix="eqxckpt-readme-"))
    os.chdir(work)
    print(f"Running the README's examples in {work}:", flush=True)
    namespace: dict = {}
    started = time.perf_counter()
    for line, code in blocks():
        reason = why_not(code)
        if reason is not None:
            print(f"  README.md:{line}: skipped, {reason}", flush=True)
            continue
        print(f"  README.md:{line}: running", flush=True)
        exec(compile(code, f"{README}:{line}", "exec"), namespace)  # noqa: S102 - our own README
    print(f"The README's examples ran in {time.perf_counter() - started:.0f} s.", flush=True)
    if not keep:
        os.chdir(README.parent)
        shutil.rmtree(work)


if __name__ == "__main__":
    main(keep="--keep" in sys.argv[1:])
