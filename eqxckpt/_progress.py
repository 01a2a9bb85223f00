"""Progress on long work: bytes and leaves done, rate, time left.

Shown only on a terminal: a rich bar on stderr, never in logs or pipes. ``"auto"``
(the default of `save`, `load`, `verify` and the conversions) shows it for work the
caller waits on that is large (`AUTO_MIN_BYTES`) or slow (still running after
`AUTO_AFTER_S`), on process 0 only; True for any size; False never. A callable instead
receives ``(done_bytes, total_bytes, done_leaves, total_leaves)`` after each leaf,
wherever the output goes. The work reports through `advance`, which does nothing unless
a report is active in this thread.
"""

import contextlib
import contextvars
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

ProgressCallback = Callable[[int, int, int, int], None]
Progress = bool | Literal["auto"] | ProgressCallback

# ``"auto"``: a bar from the start for work of at least this many bytes...
AUTO_MIN_BYTES = 1 << 30
# ...and for smaller work once it has run this long (quick work prints nothing).
AUTO_AFTER_S = 2.0

_ACTIVE: contextvars.ContextVar["Report | None"] = contextvars.ContextVar("eqxckpt_progress", default=None)


class Report:
    """One operation's progress: counts, and where they are shown."""

    def __init__(self, total_bytes: int, total_leaves: int, show: Callable[["Report"], None]):
        self.total_bytes, self.total_leaves = total_bytes, total_leaves
        self.done_bytes = self.done_leaves = 0
        self._show = show

    def advance(self, nbytes: int, leaves: int = 1) -> None:
        self.done_bytes += nbytes
        self.done_leaves += leaves
        self._show(self)


def unless_background(progress: Progress, waited_on: bool) -> Progress:
    """``progress`` for work the caller waits on or not: ``"auto"`` shows nothing for a
    background save, whose bar would run over the training loop's own output."""
    return progress if waited_on or progress != "auto" else False


@contextlib.contextmanager
def reporting(description: str, total_bytes: int, total_leaves: int, progress: Progress | None) -> Iterator[None]:
    """Make `advance` report to ``progress`` (True or ``"auto"``: a bar on a terminal) while
    the block runs."""
    if not progress:
        yield
        return
    if callable(progress):
        callback = progress
        with _active(Report(total_bytes, total_leaves, lambda r: callback(*_counts(r)))):
            yield
        return
    from rich.console import Console

    console = Console(stderr=True)
    if not console.is_terminal or (progress == "auto" and not _first_process()):  # pipes, files, CI logs: silent
        yield
        return
    bar = _rich_bar(console)
    task = None
    started = time.monotonic()

    def show(report: Report) -> None:
        nonlocal task
        if task is None:
            if progress == "auto" and total_bytes < AUTO_MIN_BYTES and time.monotonic() - started < AUTO_AFTER_S:
                return
            bar.start()
            task = bar.add_task(description, total=max(total_bytes, 1), leaves=0, total_leaves=total_leaves)
        bar.update(task, completed=report.done_bytes, leaves=report.done_leaves)

    report = Report(total_bytes, total_leaves, show)
    try:
        with _active(report):
            if progress is True or total_bytes >= AUTO_MIN_BYTES:
                show(report)
            yield
        if task is not None:
            bar.update(task, completed=max(total_bytes, 1))
    finally:
        if task is not None:
            bar.stop()


def _first_process() -> bool:
    import jax

    return jax.process_index() == 0


def advance(nbytes: int, leaves: int = 1) -> None:
    """Count ``nbytes`` and ``leaves`` as done in the active report, if any."""
    report = _ACTIVE.get()
    if report is not None:
        report.advance(nbytes, leaves)


@contextlib.contextmanager
def unreported() -> Iterator[None]:
    """`advance` counts nothing while the block runs: its work is counted otherwise (the
    small layers a `Stack` restore reads in one batch count as the stacked leaf they fill)."""
    token = _ACTIVE.set(None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def _active(report: Report) -> Iterator[None]:
    token = _ACTIVE.set(report)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _counts(report: Report) -> tuple[int, int, int, int]:
    return report.done_bytes, report.total_bytes, report.done_leaves, report.total_leaves


def _rich_bar(console: Any) -> Any:
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress as RichProgress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    return RichProgress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TextColumn("{task.fields[leaves]}/{task.fields[total_leaves]} leaves"),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )
