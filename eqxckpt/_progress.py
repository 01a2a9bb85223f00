"""Progress on long work: bytes and leaves done, rate, time left.

Opt-in (``progress=True`` on `save`, `load`, `verify`), and shown only on a
terminal: a rich bar on stderr, never in logs or pipes. A callable instead of
True receives ``(done_bytes, total_bytes, done_leaves, total_leaves)`` after
each leaf, wherever the output goes. The work reports through `advance`,
which does nothing unless a report is active in this thread.
"""

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

ProgressCallback = Callable[[int, int, int, int], None]
Progress = bool | ProgressCallback

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


@contextlib.contextmanager
def reporting(description: str, total_bytes: int, total_leaves: int, progress: Progress | None) -> Iterator[None]:
    """Make `advance` report to ``progress`` (True: a bar on a terminal) while the block runs."""
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
    if not console.is_terminal:  # pipes, files, CI logs: silent
        yield
        return
    bar = _rich_bar(console)
    task = bar.add_task(description, total=max(total_bytes, 1), leaves=0, total_leaves=total_leaves)
    with (
        bar,
        _active(
            Report(total_bytes, total_leaves, lambda r: bar.update(task, completed=r.done_bytes, leaves=r.done_leaves))
        ),
    ):
        yield
        bar.update(task, completed=max(total_bytes, 1))


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
