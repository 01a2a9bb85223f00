"""`plan_reuse`: which leaves a save takes unchanged from its base, and how (linked files on
a local disk, referred prefixes on an object store), and which it writes afresh."""

import dataclasses
import os
import time
import uuid

import numpy as np
import pytest

import eqxckpt
from eqxckpt._leaf import StoredLeaf
from eqxckpt._manifest import Manifest
from eqxckpt._paths import PACKED_LOCATION
from eqxckpt._storage import CheckpointPath, resolve
from eqxckpt._write._pack import PACK_MIN_LEAVES
from eqxckpt._write._reuse import Reuse, plan_reuse


@dataclasses.dataclass
class Job:
    """One array a save writes, as `plan_reuse` sees it."""

    record: StoredLeaf
    shard: tuple[int, ...] | None = None


def planned(path: CheckpointPath, tree: dict) -> tuple[Manifest, list[Job]]:
    """The manifest and the jobs of a save of ``tree``: those of a checkpoint of it at
    ``path`` (a save's manifest, digests included, is what it commits)."""
    eqxckpt.save(path, tree)
    stored = eqxckpt.open(path).stored
    jobs = [Job(r) for r in stored.manifest.leaves if isinstance(r, StoredLeaf) and r.offset is None]
    return stored.manifest, jobs + ([Job(stored.packed)] if stored.packed is not None else [])


def paths(jobs: list[Job]) -> list[str]:
    return [job.record.path for job in jobs]


def linked(reuse: Reuse[Job]) -> dict[str, list[str]]:
    return {job.record.path: files for job, files, _ in reuse.linked}


TREE = {
    "a": np.arange(70_000, dtype=np.float32),
    "b": np.ones(70_000, np.float32),
    "small": [np.full(4, i, np.float32) for i in range(PACK_MIN_LEAVES)],
}


def test_unchanged_leaves_are_linked_and_changed_ones_written(tmp_path):
    eqxckpt.save(tmp_path / "base", TREE)
    manifest, jobs = planned(tmp_path / "new", {**TREE, "b": np.zeros(70_000, np.float32), "c": np.ones(70_000)})
    with plan_reuse(tmp_path / "base", manifest, jobs, resolve(tmp_path / "next")) as reuse:
        assert reuse.base is not None and reuse.base.manifest.metadata == {}
        assert linked(reuse) == {
            "a": ["a/c/0", "a/zarr.json"],
            PACKED_LOCATION: [f"{PACKED_LOCATION}/c/0", f"{PACKED_LOCATION}/zarr.json"],
        }
        assert paths(reuse.written) == ["b", "c"] and reuse.referred == []
    # Every job is in exactly one of the three.
    assert sorted(paths(reuse.written) + list(linked(reuse))) == sorted(paths(jobs))


def test_a_damaged_base_leaf_is_written_with_a_warning(tmp_path):
    eqxckpt.save(tmp_path / "base", TREE)
    chunk = tmp_path / "base" / "a" / "c" / "0"
    data = bytearray(chunk.read_bytes())
    data[100] ^= 1
    chunk.write_bytes(bytes(data))
    manifest, jobs = planned(tmp_path / "new", TREE)
    with pytest.warns(UserWarning, match="Leaf 'a' of .*base.* is damaged there"):
        reuse = plan_reuse(tmp_path / "base", manifest, jobs, resolve(tmp_path / "next"))
    with reuse:
        assert paths(reuse.written) == ["a"]
        assert sorted(linked(reuse)) == sorted([PACKED_LOCATION, "b"])


def test_a_different_packing_writes_the_packed_array_again(tmp_path):
    eqxckpt.save(tmp_path / "base", TREE)
    small = [np.full(4, i, np.float32) for i in range(PACK_MIN_LEAVES)]
    small[3] = np.full(4, -1, np.float32)  # one packed leaf changed: the packed array is rewritten whole
    manifest, jobs = planned(tmp_path / "new", {**TREE, "small": small})
    with plan_reuse(tmp_path / "base", manifest, jobs, resolve(tmp_path / "next")) as reuse:
        assert paths(reuse.written) == [PACKED_LOCATION]
        assert sorted(linked(reuse)) == ["a", "b"]


def test_leaves_without_a_digest_or_written_by_shards_are_written(tmp_path):
    eqxckpt.save(tmp_path / "base", TREE)
    manifest, jobs = planned(tmp_path / "new", TREE)
    undigested = dataclasses.replace(
        manifest,
        leaves=tuple(
            dataclasses.replace(r, digest=None) if isinstance(r, StoredLeaf) and r.path == "a" else r
            for r in manifest.leaves
        ),
    )
    jobs = [Job(job.record, (35_000,)) if job.record.path == "b" else job for job in jobs]
    with plan_reuse(tmp_path / "base", undigested, jobs, resolve(tmp_path / "next")) as reuse:
        assert paths(reuse.written) == ["a", "b"] and list(linked(reuse)) == [PACKED_LOCATION]


def test_a_local_base_holds_until_closed(tmp_path):
    eqxckpt.save(tmp_path / "base", TREE)
    manifest, jobs = planned(tmp_path / "new", TREE)
    reuse = plan_reuse(tmp_path / "base", manifest, jobs, resolve(tmp_path / "next"))
    assert reuse.base is not None and not resolve(tmp_path / "base").delete()  # held: in use
    reuse.close()
    assert resolve(tmp_path / "base").delete() and not (tmp_path / "base").exists()


def test_on_an_object_store_unchanged_leaves_refer_to_the_sibling_prefix():
    run = f"memory://reuse-{uuid.uuid4().hex}/"
    eqxckpt.save(run + "1", TREE)
    arrays = eqxckpt.open(run + "1").stored.manifest.arrays
    manifest, jobs = planned(run + "scratch/new", {**TREE, "b": np.zeros(70_000, np.float32)})
    with plan_reuse(run + "1", manifest, jobs, resolve(run + "2")) as reuse:
        assert {job.record.path: ref for job, ref, _ in reuse.referred} == {
            "a": f"../1/{arrays}",
            PACKED_LOCATION: f"../1/{arrays}",
        }
        assert paths(reuse.written) == ["b"] and reuse.linked == []
        # Checked whole now: the generations of a's objects (its zarr.json and one chunk).
        seen = {job.record.path: seen for job, _, seen in reuse.referred}
        assert seen["a"] is not None and seen["a"].shares == 0 and len(seen["a"].generations) == 2
        assert seen[PACKED_LOCATION] is None  # the packed array is checked whole every time
    # A checkpoint that refers to 1 is a base whose leaves are in 1's prefix: not chained.
    eqxckpt.save(run + "2", {**TREE, "b": np.zeros(70_000, np.float32)}, base=run + "1")
    recorded = eqxckpt.open(run + "2").leaf("a")
    assert isinstance(recorded, StoredLeaf) and recorded.seen is not None and recorded.seen.shares == 0
    with plan_reuse(run + "2", manifest, jobs, resolve(run + "3")) as reuse:
        assert {job.record.path: ref for job, ref, _ in reuse.referred}["a"] == f"../1/{arrays}"
        assert {job.record.path for job, _, _ in reuse.referred} == {"a", "b", PACKED_LOCATION}
        # Shared on the generations 2 recorded, unread: one more share, the same check time.
        seen = {job.record.path: seen for job, _, seen in reuse.referred}
        assert seen["a"] == dataclasses.replace(recorded.seen, shares=1)
    with plan_reuse(run + "2", manifest, jobs, resolve(run + "3"), full_check_interval_s=0) as reuse:
        seen = {job.record.path: seen for job, _, seen in reuse.referred}
        assert seen["a"] is not None and seen["a"].shares == 0 and seen["a"].unix > recorded.seen.unix


@pytest.mark.parametrize("where", ["memory", "other directory", "missing", "none"])
def test_a_base_that_cannot_be_taken_from_gives_nothing(tmp_path, where):
    run = f"memory://reuse-{uuid.uuid4().hex}/"
    eqxckpt.save(tmp_path / "local", TREE)
    eqxckpt.save(run + "1", TREE)
    manifest, jobs = planned(tmp_path / "new", TREE)
    base, location = {
        "memory": (run + "1", resolve(tmp_path / "next")),  # another backend, both ways
        "other directory": (run + "1", resolve(run + "elsewhere/2")),  # not a sibling
        "missing": (tmp_path / "nothing", resolve(tmp_path / "next")),
        "none": (None, resolve(tmp_path / "next")),
    }[where]
    with plan_reuse(base, manifest, jobs, location) as reuse:
        assert reuse.base is None and reuse.linked == [] and reuse.referred == []
        assert reuse.written == jobs
    with plan_reuse(tmp_path / "local", manifest, jobs, resolve(run + "2")) as reuse:
        assert reuse.base is None and reuse.written == jobs


def test_a_save_links_exactly_what_plan_reuse_linked(tmp_path):
    eqxckpt.save(tmp_path / "base", TREE)
    changed = {**TREE, "b": np.zeros(70_000, np.float32)}
    eqxckpt.save(tmp_path / "next", changed, base=tmp_path / "base")
    shared = lambda key: os.stat(tmp_path / "next" / key).st_ino == os.stat(tmp_path / "base" / key).st_ino  # noqa: E731
    assert shared("a/c/0") and shared(f"{PACKED_LOCATION}/c/0") and not shared("b/c/0")
    np.testing.assert_array_equal(eqxckpt.load(tmp_path / "next")["b"], np.zeros(70_000, np.float32))


def test_a_lazy_key_array_saved_elsewhere_is_its_own_array_there(tmp_path):
    """The outside attack: a lazy PRNG key array from a step that refers to a sibling's
    prefix, saved into another checkpoint, kept the sibling's reference (and what was seen
    there): a checkpoint naming a prefix it never checked nor held, unreadable on a disk."""
    import jax

    run = f"memory://reuse-key-{uuid.uuid4().hex}/"
    keys = jax.random.split(jax.random.key(7), 4096)
    eqxckpt.save(run + "1", {"k": keys, "h": np.zeros(3, np.float32)})
    eqxckpt.save(run + "2", {"k": keys, "h": np.ones(3, np.float32)}, base=run + "1")
    assert eqxckpt.open(run + "2").leaf("k").arrays is not None
    for where in (run + "3", str(tmp_path / "c")):
        eqxckpt.save(where, {"k": eqxckpt.open(run + "2")["k"]})
        leaf = eqxckpt.open(where).leaf("k")
        assert isinstance(leaf, StoredLeaf) and leaf.arrays is None and leaf.seen is None
        assert np.array_equal(jax.random.key_data(eqxckpt.load(where)["k"]), jax.random.key_data(keys))


def test_generations_a_manifest_cannot_hold_are_not_recorded(monkeypatch):
    """The outside attack: a store whose generations are longer than a manifest accepts
    (over 128 bytes) made a save commit a manifest every load refused. Such a leaf is
    recorded as unseen, and checked whole each time."""
    from eqxckpt._storage import Storage

    run = f"memory://reuse-long-{uuid.uuid4().hex}/"
    eqxckpt.save(run + "1", {"w": np.arange(40_000, dtype=np.float32)})
    asked = Storage.generations
    monkeypatch.setattr(Storage, "generations", lambda self, keys: [g and g + "ab" * 150 for g in asked(self, keys)])
    eqxckpt.save(run + "2", {"w": np.arange(40_000, dtype=np.float32)}, base=run + "1")
    leaf = eqxckpt.open(run + "2").leaf("w")
    assert isinstance(leaf, StoredLeaf) and leaf.arrays is not None and leaf.seen is None
    assert eqxckpt.load(run + "2")["w"].tolist() == list(range(40_000))


# --- the stamp rule: a local leaf checked whole is shared unread while no write touched it ---

FROZEN = {"frozen": np.arange(200_000, dtype=np.float32), "head": np.zeros(8, np.float32)}


@pytest.fixture
def chunk_reads(monkeypatch) -> list[str]:
    """The key of every chunk file read through a local disk's chunk files."""
    from eqxckpt._storage._disk_chunks import LocalChunkFiles

    keys: list[str] = []
    read = LocalChunkFiles._read_ranges

    def counted(self, key, ranges, size):
        keys.append(key)
        return read(self, key, ranges, size)

    monkeypatch.setattr(LocalChunkFiles, "_read_ranges", counted)
    return keys


def seen_of(path, leaf: str = "frozen"):
    record = eqxckpt.open(path).stored.stored_leaf(leaf)
    assert record is not None
    return record.seen


def step(tmp_path, number: int, head: float = 0.0, **kwargs) -> None:
    """Save step ``number`` of a run whose frozen leaf never changes, on the step before.
    Step 0's files are made an hour old: a check vouches only for files modified at least
    `SETTLE_S` before it read them (a write may still be landing)."""
    base = tmp_path / "run" / str(number - 1) if number else None
    eqxckpt.save(tmp_path / "run" / str(number), {**FROZEN, "head": FROZEN["head"] + head}, base=base, **kwargs)
    if not number:
        for file in (tmp_path / "run" / "0" / "frozen").rglob("*"):
            if file.is_file():
                os.utime(file, (time.time() - 3600, time.time() - 3600))


def frozen_reads(keys: list[str]) -> list[str]:
    return [key for key in keys if key.startswith("frozen/")]


def test_a_frozen_leaf_is_read_once_then_shared_unread_across_deletions(tmp_path, chunk_reads):
    step(tmp_path, 0)
    step(tmp_path, 1)  # checks the leaf it shares: reads it, records its files' stamps
    assert frozen_reads(chunk_reads) == ["frozen/c/0"]
    first = seen_of(tmp_path / "run" / "1")
    assert first is not None and first.shares == 0 and len(first.generations) == 2
    chunk_reads.clear()
    for number in range(2, 6):
        step(tmp_path, number, head=number)
        # Retention's deletion unlinks a name of the shared file: its stamp changes, its bytes not.
        eqxckpt.open(tmp_path / "run" / str(number - 2)).stored.storage.delete()
        assert seen_of(tmp_path / "run" / str(number)) == dataclasses.replace(first, shares=number - 1)
    assert frozen_reads(chunk_reads) == []  # not read, not downloaded: counted
    loaded = eqxckpt.load(tmp_path / "run" / "5")
    np.testing.assert_array_equal(loaded["frozen"], FROZEN["frozen"])


def _flip(path) -> None:
    with open(path, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 4]))


def _flip_keeping_mtime(path) -> None:
    before = os.stat(path)
    _flip(path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # the change time still moves


def _truncate(path) -> None:
    os.truncate(path, os.path.getsize(path) - 4)


def _replace_with_same_bytes(path) -> None:
    before = os.stat(path)
    other = path.with_name("copy")
    other.write_bytes(path.read_bytes())
    os.utime(other, ns=(before.st_atime_ns, before.st_mtime_ns))
    os.rename(other, path)  # another file, renamed over it: another inode


def _rename_over_with_other_bytes(path) -> None:
    body = bytearray(path.read_bytes())
    body[1000] ^= 4
    other = path.with_name("copy")
    other.write_bytes(bytes(body))
    os.rename(other, path)


@pytest.mark.parametrize(
    "fault,damaged,read",
    [
        (_flip, True, True),
        (_flip_keeping_mtime, True, True),
        (_truncate, True, False),  # not the size its layout gives: written afresh unread
        (_rename_over_with_other_bytes, True, True),
        (_replace_with_same_bytes, False, True),
    ],
)
def test_any_write_since_the_check_makes_the_next_save_read_and_check(tmp_path, chunk_reads, fault, damaged, read):
    for number in range(3):
        step(tmp_path, number)
    assert seen_of(tmp_path / "run" / "2").shares == 1
    chunk_reads.clear()
    fault(tmp_path / "run" / "2" / "frozen" / "c" / "0")
    if damaged and read:
        with pytest.warns(UserWarning, match="Leaf 'frozen' of .* is damaged there"):
            step(tmp_path, 3)
    else:
        step(tmp_path, 3)
    assert frozen_reads(chunk_reads) == ["frozen/c/0"] * read
    # Written afresh from the values (damaged) or checked and shared (sound): exact either way,
    # and checked afresh, so its count starts again.
    np.testing.assert_array_equal(eqxckpt.load(tmp_path / "run" / "3")["frozen"], FROZEN["frozen"])
    assert (seen_of(tmp_path / "run" / "3") is None) == damaged
    if not damaged:
        assert seen_of(tmp_path / "run" / "3").shares == 0


def test_the_full_check_bounds_hold_on_a_local_disk(tmp_path, chunk_reads, monkeypatch):
    from eqxckpt._write import _reuse

    step(tmp_path, 0)
    step(tmp_path, 1)
    step(tmp_path, 2, full_check_interval_s=0)  # every step checks whole
    assert frozen_reads(chunk_reads) == ["frozen/c/0"] * 2
    monkeypatch.setattr(_reuse, "FULL_CHECK_SHARES", 2)
    chunk_reads.clear()
    step(tmp_path, 3)  # shared unread once since the check at step 2
    step(tmp_path, 4)  # the second: checked whole again
    assert frozen_reads(chunk_reads) == ["frozen/c/0"]
    assert seen_of(tmp_path / "run" / "4").shares == 0


def test_a_damaged_or_missing_stamp_book_means_reading_again(tmp_path, chunk_reads):
    from eqxckpt._storage._stamps import BOOK_NAME

    for number in range(3):
        step(tmp_path, number)
    book = tmp_path / "run" / BOOK_NAME
    raw = bytearray(book.read_bytes())
    raw[-3] ^= 1
    book.write_bytes(bytes(raw))
    chunk_reads.clear()
    step(tmp_path, 3)  # the link at step 2 changed the change time: only the book vouched for it
    assert frozen_reads(chunk_reads) == ["frozen/c/0"]
    book.unlink()
    chunk_reads.clear()
    step(tmp_path, 4)
    assert frozen_reads(chunk_reads) == ["frozen/c/0"]
    step(tmp_path, 5)
    assert frozen_reads(chunk_reads) == ["frozen/c/0"]  # and from then on unread again


def test_a_write_racing_the_link_of_a_shared_file_is_read_at_the_next_step(tmp_path, chunk_reads, monkeypatch):
    from eqxckpt._storage import _disk

    for number in range(2):
        step(tmp_path, number)
    link = _disk.link_or_copy

    def racing(source, target):
        if str(source).endswith("frozen/c/0"):  # another process writes between the stamp and the link
            _flip(source)
        return link(source, target)

    monkeypatch.setattr(_disk, "link_or_copy", racing)
    step(tmp_path, 2)  # shares it unread (checked at step 1), linking as the write lands
    monkeypatch.setattr(_disk, "link_or_copy", link)
    chunk_reads.clear()
    with pytest.warns(UserWarning, match="Leaf 'frozen' of .* is damaged there"):
        step(tmp_path, 3)
    assert frozen_reads(chunk_reads) == ["frozen/c/0"]
    np.testing.assert_array_equal(eqxckpt.load(tmp_path / "run" / "3")["frozen"], FROZEN["frozen"])


def test_a_file_modified_just_before_its_check_is_checked_again_at_the_next_step(tmp_path, chunk_reads):
    """A write sets the times when it begins: a check reading a file modified less than
    SETTLE_S before may have read bytes that write had not yet replaced, so it records no
    stamp, and the next step reads the file again (then, once settled, vouches for it)."""
    eqxckpt.save(tmp_path / "run" / "0", FROZEN)  # written just now, as a write in flight would be
    for number in (1, 2):
        step(tmp_path, number)
        assert seen_of(tmp_path / "run" / str(number)) is None
    assert frozen_reads(chunk_reads) == ["frozen/c/0"] * 2
    for file in (tmp_path / "run" / "2" / "frozen").rglob("*"):
        if file.is_file():
            os.utime(file, (time.time() - 3600, time.time() - 3600))
    step(tmp_path, 3)
    step(tmp_path, 4)
    assert frozen_reads(chunk_reads) == ["frozen/c/0"] * 3 and seen_of(tmp_path / "run" / "4").shares == 1


def test_a_leafs_metadata_modified_just_before_its_check_is_not_vouched_for(tmp_path):
    """The settle rule covers every file of the leaf: its zarr.json too, not only chunks."""
    step(tmp_path, 0)  # its files an hour old
    metadata = tmp_path / "run" / "0" / "frozen" / "zarr.json"
    metadata.write_bytes(metadata.read_bytes())  # written just now, same bytes
    step(tmp_path, 1)
    assert seen_of(tmp_path / "run" / "1") is None


def test_the_stamp_book_is_parsed_once_per_save_not_once_per_leaf(tmp_path, monkeypatch):
    from eqxckpt._storage import _stamps

    frozen = {f"w{i}": np.full(70_000, i, np.float32) for i in range(12)}
    eqxckpt.save(tmp_path / "run" / "0", frozen)
    for file in (tmp_path / "run" / "0").rglob("*"):
        os.utime(file, (time.time() - 3600, time.time() - 3600))
    eqxckpt.save(tmp_path / "run" / "1", frozen, base=tmp_path / "run" / "0")  # the book is made
    parsed: list[int] = []
    read = _stamps._read
    monkeypatch.setattr(_stamps, "_read", lambda fd: parsed.append(fd) or read(fd))
    _stamps._PARSED.clear()
    eqxckpt.save(tmp_path / "run" / "2", frozen, base=tmp_path / "run" / "1", full_check_interval_s=0)
    # Twice for 12 leaves, never per leaf: the stamps the check asks, then the book again once
    # this save has recorded its own files in it (a changed book is parsed anew).
    assert len(parsed) == 2


def test_a_base_in_another_directory_gets_no_stamp_book(tmp_path):
    from eqxckpt._storage._stamps import BOOK_NAME

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "README").write_text("the team's models")
    eqxckpt.save(tmp_path / "models" / "pretrained", FROZEN)
    eqxckpt.save(tmp_path / "run" / "0", FROZEN, base=tmp_path / "models" / "pretrained")
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["README", "pretrained"]
    assert (tmp_path / "run" / BOOK_NAME).exists()
