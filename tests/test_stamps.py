"""`_storage._stamps`: a file's stamp, and a run's book of the stamps eqxckpt's own links and
unlinks gave its shared files."""

import os

import pytest
from hypothesis import given, settings, strategies as st

from eqxckpt._storage._stamps import BOOK_NAME, StampBook, stamp_of, unlink_shared


def test_a_link_and_an_unlink_keep_the_generation_a_write_does_not(tmp_path):
    file = tmp_path / "run" / "1" / "w"
    file.parent.mkdir(parents=True)
    file.write_bytes(b"x" * 100)
    checked = StampBook(tmp_path / "run").generations([os.lstat(file)])[0]
    assert checked == stamp_of(os.lstat(file))
    before = os.lstat(file)
    os.link(file, tmp_path / "run" / "w2")
    StampBook(tmp_path / "run").record([(before, os.lstat(file))])
    assert stamp_of(os.lstat(file)) != checked  # the link moved the change time
    assert StampBook(tmp_path / "run").generations([os.lstat(file)]) == [checked]
    unlink_shared(tmp_path / "run" / "1")  # a step deleted: its name of the file goes
    assert not file.exists()
    assert StampBook(tmp_path / "run").generations([os.lstat(tmp_path / "run" / "w2")]) == [checked]
    with open(tmp_path / "run" / "w2", "r+b") as f:
        f.write(b"y")
    assert StampBook(tmp_path / "run").generations([os.lstat(tmp_path / "run" / "w2")]) != [checked]


@pytest.mark.parametrize("kind", ["symlink", "directory", "fifo", "garbage", "huge"])
def test_a_book_that_is_not_one_is_read_as_empty_and_never_blocks(tmp_path, kind):
    file = tmp_path / "w"
    file.write_bytes(b"x")
    book = tmp_path / BOOK_NAME
    if kind == "symlink":
        (tmp_path / "elsewhere").write_bytes(b"{}")
        book.symlink_to(tmp_path / "elsewhere")
    elif kind == "directory":
        book.mkdir()
    elif kind == "fifo":
        os.mkfifo(book)
    elif kind == "garbage":
        book.write_bytes(b"00000000\n{not json")
    else:
        with open(book, "wb") as f:
            f.truncate((64 << 20) + 1)
    before = os.lstat(file)
    os.link(file, tmp_path / "w2")
    after = os.lstat(file)
    StampBook(tmp_path).record([(before, after)])  # cannot be written (or rewritten whole): no error
    got = StampBook(tmp_path).generations([after])
    assert got == [stamp_of(after)] or (kind in ("garbage", "huge") and got == [stamp_of(before)])
    if kind == "symlink":
        assert (tmp_path / "elsewhere").read_bytes() == b"{}"  # never written through


@settings(max_examples=50, deadline=None)
@given(flips=st.lists(st.integers(0, 10_000), min_size=1, max_size=3))
def test_a_book_with_any_byte_changed_vouches_for_nothing_new(tmp_path_factory, flips):
    root = tmp_path_factory.mktemp("book")
    file = root / "w"
    file.write_bytes(b"x")
    before = os.lstat(file)
    os.link(file, root / "w2")
    after = os.lstat(file)
    StampBook(root).record([(before, after)])
    raw = bytearray((root / BOOK_NAME).read_bytes())
    for at in flips:
        raw[at % len(raw)] ^= 1 << (at % 7)
    (root / BOOK_NAME).write_bytes(bytes(raw))
    # Vouches for the checked stamp as recorded, or (damaged) for nothing but the file's own.
    assert StampBook(root).generations([after])[0] in (stamp_of(before), stamp_of(after))


def _linked(tmp_path):
    file = tmp_path / "w"
    file.write_bytes(b"x" * 100)
    before = os.lstat(file)
    os.link(file, tmp_path / "w2")
    return file, before


def test_a_write_between_the_two_stamps_of_a_link_is_never_recorded_as_the_link(tmp_path):
    file, before = _linked(tmp_path)
    with open(file, "r+b") as f:  # another process's write, landing in the link's window
        f.write(b"y")
    StampBook(tmp_path).record([(before, os.lstat(file))])
    assert StampBook(tmp_path).generations([os.lstat(file)]) == [stamp_of(os.lstat(file))]


def test_a_book_another_process_holds_is_waited_for_a_second_then_left(tmp_path):
    import fcntl
    import time

    file, before = _linked(tmp_path)
    StampBook(tmp_path).record([(before, os.lstat(file))])
    held = os.open(tmp_path / BOOK_NAME, os.O_RDONLY)  # read access is enough to lock it
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        start = time.monotonic()
        assert StampBook(tmp_path).generations([os.lstat(file)]) == [stamp_of(os.lstat(file))]
        again = os.lstat(file)
        os.link(file, tmp_path / "w3")
        StampBook(tmp_path).record([(again, os.lstat(file))])  # not recorded, no error
        assert time.monotonic() - start < 10
    finally:
        os.close(held)
    assert StampBook(tmp_path).generations([os.lstat(file)]) == [stamp_of(os.lstat(file))]


def test_a_filesystem_without_locks_uses_the_book_unlocked(tmp_path, monkeypatch):
    import errno
    import fcntl

    from eqxckpt._storage import _stamps

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(_stamps.fcntl, "flock", no_locks)
    file, before = _linked(tmp_path)
    StampBook(tmp_path).record([(before, os.lstat(file))])
    assert StampBook(tmp_path).generations([os.lstat(file)]) == [stamp_of(before)]
    assert fcntl.LOCK_EX  # (the real module is untouched outside _stamps)


def test_a_book_hard_linked_from_outside_the_run_is_never_rewritten_there(tmp_path):
    file, before = _linked(tmp_path)
    StampBook(tmp_path).record([(before, os.lstat(file))])
    snapshot = tmp_path.parent / f"{tmp_path.name}-snapshot-book"
    os.link(tmp_path / BOOK_NAME, snapshot)  # cp -al of the run
    kept = snapshot.read_bytes()
    again = os.lstat(file)
    os.link(file, tmp_path / "w3")
    StampBook(tmp_path).record([(again, os.lstat(file))])
    assert snapshot.read_bytes() == kept and os.lstat(tmp_path / BOOK_NAME).st_nlink == 1
    assert StampBook(tmp_path).generations([os.lstat(file)]) == [stamp_of(before)]
    assert not [p for p in tmp_path.iterdir() if "eqxckpt-tmp" in p.name]  # no temporary left


def test_a_book_replaced_while_its_lock_was_waited_for_is_not_written(tmp_path):
    import fcntl
    import threading

    file, before = _linked(tmp_path)
    StampBook(tmp_path).record([(before, os.lstat(file))])
    snapshot = tmp_path.parent / f"{tmp_path.name}-snapshot-book2"
    os.link(tmp_path / BOOK_NAME, snapshot)
    kept = snapshot.read_bytes()
    reader = os.open(tmp_path / BOOK_NAME, os.O_RDONLY)
    fcntl.flock(reader, fcntl.LOCK_SH)  # another reader holds it
    again = os.lstat(file)
    os.link(file, tmp_path / "w3")
    after = os.lstat(file)
    waiting = threading.Thread(target=lambda: StampBook(tmp_path).record([(again, after)]))
    waiting.start()
    # Meanwhile another save puts a new book in its place (as one does for a linked book).
    fresh = tmp_path / "fresh"
    fresh.write_bytes(b"")
    os.rename(fresh, tmp_path / BOOK_NAME)
    os.close(reader)
    waiting.join()
    assert snapshot.read_bytes() == kept  # the old book, now only the snapshot's, untouched


def test_a_new_book_a_killed_save_left_is_removed_by_the_next(tmp_path):
    from eqxckpt._storage._fs import hidden_sibling

    leftover = hidden_sibling(tmp_path / BOOK_NAME, "tmp")  # a replacement never renamed into place
    leftover.write_bytes(b"half a book")
    mine = tmp_path / "notes.eqxckpt-stamps.0123456789ab"
    mine.write_bytes(b"a user's")
    file, before = _linked(tmp_path)
    StampBook(tmp_path).record([(before, os.lstat(file))])
    assert not leftover.exists() and mine.exists()


def test_a_held_book_is_waited_for_once_not_once_per_file(tmp_path):
    import fcntl
    import time

    from eqxckpt._storage import _stamps

    file, before = _linked(tmp_path)
    StampBook(tmp_path).record([(before, os.lstat(file))])
    held = os.open(tmp_path / BOOK_NAME, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        StampBook(tmp_path).generations([os.lstat(file)])  # waits once
        start = time.monotonic()
        for _ in range(20):  # a save asks once per leaf it checks
            StampBook(tmp_path).generations([os.lstat(file)])
        assert time.monotonic() - start < _stamps.BOOK_LOCK_WAIT_S
    finally:
        os.close(held)
        _stamps._BUSY.clear()


def test_a_deeply_nested_book_reads_as_empty(tmp_path):
    from crc32c import crc32c

    file, before = _linked(tmp_path)
    body = b"[" * 200_000 + b"]" * 200_000
    (tmp_path / BOOK_NAME).write_bytes(b"%08x\n" % crc32c(body) + body)
    assert StampBook(tmp_path).generations([os.lstat(file)]) == [stamp_of(os.lstat(file))]


def test_unlinking_a_steps_shared_files_never_leaves_it_nor_touches_kept_files(tmp_path):
    run, outside = tmp_path / "run", tmp_path / "outside"
    (run / "1" / "w").mkdir(parents=True)
    outside.mkdir()
    for directory, other in ((run / "1" / "w", run / "2-f"), (outside, tmp_path / "outside-f")):
        (directory / "f").write_bytes(b"x")
        os.link(directory / "f", other)  # its name in another step, or elsewhere
    (run / "1" / "notes").write_bytes(b"mine")
    os.link(run / "1" / "notes", tmp_path / "notes-elsewhere")
    (run / "1" / "link").symlink_to(outside)  # a directory swapped for a symlink
    (run / BOOK_NAME).write_bytes(b"")  # the run has a book
    unlink_shared(run / "1", keep=["notes"])
    assert not (run / "1" / "w" / "f").exists()  # shared: unlinked, its stamp recorded
    assert (outside / "f").exists() and (run / "1" / "notes").exists()
    before = os.lstat(run / "2-f")
    assert StampBook(run).generations([before])[0] != stamp_of(before)  # the unlink's stamp is known
