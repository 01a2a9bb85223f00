"""`interrupts_deferred`: Ctrl-C held back while a step that must not be cut in two runs."""

import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold back Ctrl-C (SIGINT) until the block is done, then raise it. Only the main
    thread receives signals, and only Python's default handler is replaced."""
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    received: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if received:
            raise KeyboardInterrupt
