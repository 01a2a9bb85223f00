"""Incremental saves on S3 and Cloud Storage (`_write._reuse` on moto and fake-gcs-server,
through a counting proxy on 127.0.0.1): a leaf checked whole once is shared by later
steps without downloading a byte of it while the store reports its objects unchanged."""

import itertools
import uuid
import warnings

import numpy as np
import pytest
from conftest import CountingProxy

import eqxckpt
import eqxckpt._write._reuse as reuse_module
from eqxckpt._leaf import StoredLeaf

FROZEN = np.random.default_rng(0).standard_normal((512, 1024)).astype(np.float32)  # 2 MiB


def _spec(store, proxy, prefix, monkeypatch):
    if store.name == "s3":
        return lambda entry: {**store.spec(f"{prefix}{entry}"), "endpoint": proxy.endpoint}
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", proxy.endpoint)
    # A context of its own for each proxy: TensorStore keeps an open driver per context, with
    # the endpoint it opened with (one shared by two tests sent the second's requests past
    # its proxy, uncounted).
    context = {"gcs_request_retries": {"max_retries": next(_CONTEXTS)}}
    return lambda entry: {**store.spec(f"{prefix}{entry}"), "context": context}


_CONTEXTS = itertools.count(100)


def _downloads(proxy, name: str) -> list[tuple[str, str, str | None]]:
    """Requests for the bytes of leaf ``name``'s objects (not their metadata: a HEAD on
    S3, ``alt=json`` on Cloud Storage)."""
    return [
        (method, key, byte_range)
        for method, key, byte_range in proxy.requests
        if f"/{name}/" in key and method == "GET" and "alt=json" not in key
    ]


def _asked(proxy, name: str) -> int:
    """Metadata requests for leaf ``name``'s objects."""
    return sum(1 for method, key, _ in proxy.requests if f"/{name}/" in key and (method == "HEAD" or "alt=json" in key))


def test_a_leaf_checked_once_is_shared_unread_until_its_objects_change(store, monkeypatch):
    """Step 1 writes a 2 MiB frozen leaf; step 2 downloads and checks it whole and records
    its objects' generations; steps 3 and 4 share it with one metadata request per object
    and not one byte of it downloaded. Then one of its chunks is replaced in step 1's
    prefix (another valid chunk file: its CRC-32C passes): step 5 sees the generation
    change, downloads and checks it, finds the digest wrong, warns and writes it afresh.
    Every step loads bit-exact. With ``full_check_interval_s=0`` every step downloads it."""
    proxy = CountingProxy(store.endpoint, delay=0.0)
    prefix = f"reuse-seen-{uuid.uuid4().hex[:8]}/"
    at = _spec(store, proxy, prefix, monkeypatch)
    try:
        head = lambda step: np.full(64, step, np.float32)  # noqa: E731 - changes every step
        eqxckpt.save(at("1"), {"frozen": FROZEN, "head": head(1)})
        proxy.reset()
        eqxckpt.save(at("2"), {"frozen": FROZEN, "head": head(2)}, base=at("1"))
        assert len(_downloads(proxy, "frozen")) >= 1  # checked whole: its chunk downloaded
        leaf = eqxckpt.open(at("2")).leaf("frozen")
        assert isinstance(leaf, StoredLeaf) and leaf.arrays is not None and leaf.seen is not None
        objects = len(leaf.seen.generations)  # its zarr.json and its chunk
        for step in (3, 4):
            proxy.reset()
            eqxckpt.save(at(step), {"frozen": FROZEN, "head": head(step)}, base=at(step - 1))
            assert _downloads(proxy, "frozen") == [], _downloads(proxy, "frozen")
            assert _asked(proxy, "frozen") == objects
            shared = eqxckpt.open(at(step)).leaf("frozen")
            assert isinstance(shared, StoredLeaf) and shared.seen is not None
            assert shared.seen.shares == step - 2 and shared.seen.generations == leaf.seen.generations
            assert shared.arrays == leaf.arrays  # step 1's prefix, never chained
        loaded = eqxckpt.load(at("4"))
        assert np.asarray(loaded["frozen"]).tobytes() == FROZEN.tobytes() and loaded["head"][0] == 4
        # One chunk of the frozen leaf replaced where it is (step 1's prefix) by a chunk file
        # of other values with a sound CRC-32C: only the digest can tell.
        [chunk] = [key for key in store.keys(prefix + "1/") if "/frozen/c/" in key]
        other = np.ascontiguousarray(FROZEN[::-1])
        eqxckpt.save(at("other"), {"frozen": other})
        [other_chunk] = [key for key in store.keys(prefix + "other/") if "/frozen/c/" in key]
        store.put(chunk, store.get(other_chunk))
        proxy.reset()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            eqxckpt.save(at("5"), {"frozen": FROZEN, "head": head(5)}, base=at("4"))
        assert any("'frozen'" in str(w.message) and "damaged" in str(w.message) for w in caught), caught
        assert len(_downloads(proxy, "frozen")) >= 1
        written = eqxckpt.open(at("5")).leaf("frozen")
        assert isinstance(written, StoredLeaf) and written.arrays is None and written.seen is None
        assert np.asarray(eqxckpt.load(at("5"))["frozen"]).tobytes() == FROZEN.tobytes()
        # Step 6 checks step 5's own copy whole; 0 seconds: step 7 downloads it again.
        proxy.reset()
        eqxckpt.save(at("6"), {"frozen": FROZEN, "head": head(6)}, base=at("5"))
        assert len(_downloads(proxy, "frozen")) >= 1
        proxy.reset()
        eqxckpt.save(at("7"), {"frozen": FROZEN, "head": head(7)}, base=at("6"), full_check_interval_s=0)
        assert len(_downloads(proxy, "frozen")) >= 1
        assert np.asarray(eqxckpt.load(at("7"))["frozen"]).tobytes() == FROZEN.tobytes()
    finally:
        proxy.close()


def test_the_share_count_and_the_interval_bound_sharing_unread(store, monkeypatch):
    """After `FULL_CHECK_SHARES` saves shared it unread, or once `full_check_interval_s`
    has passed since its check, a leaf is downloaded and checked whole again."""
    monkeypatch.setattr(reuse_module, "FULL_CHECK_SHARES", 3)
    proxy = CountingProxy(store.endpoint, delay=0.0)
    prefix = f"reuse-bound-{uuid.uuid4().hex[:8]}/"
    at = _spec(store, proxy, prefix, monkeypatch)
    try:
        eqxckpt.save(at("0"), {"frozen": FROZEN})
        read = []
        for step in range(1, 7):
            proxy.reset()
            eqxckpt.save(at(step), {"frozen": FROZEN, "step": step}, base=at(step - 1))
            read.append(bool(_downloads(proxy, "frozen")))
        # Checked at 1; shared unread at 2 and 3 (shares 1, 2); the third share is refused.
        assert read == [True, False, False, True, False, False], read
        clock = {"now": __import__("time").time() + 7200}
        monkeypatch.setattr(reuse_module.time, "time", lambda: clock["now"])
        proxy.reset()
        eqxckpt.save(at("7"), {"frozen": FROZEN}, base=at("6"))  # two hours later: checked again
        assert _downloads(proxy, "frozen")
    finally:
        proxy.close()


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), True, "3600"])
def test_a_full_check_interval_that_is_not_seconds_is_refused(tmp_path, bad):
    with pytest.raises(eqxckpt.CheckpointError, match="full_check_interval_s must be a number"):
        eqxckpt.save(tmp_path / "c", {"w": np.zeros(3)}, full_check_interval_s=bad)
    assert not (tmp_path / "c").exists()


def test_a_leaf_stored_in_other_chunks_than_planned_is_never_shared_unread(store, monkeypatch):
    """The outside attack on this rule: a base saved with smaller chunks than a save plans
    (sharded, or another chunk size) recorded the generations of the planned chunks only,
    and a chunk it did not watch was replaced unseen. Now nothing is recorded unless the
    chunks the check read are the planned ones: every step checks such a leaf whole."""
    import eqxckpt._chunks as chunks_module

    prefix = f"reuse-layout-{uuid.uuid4().hex[:8]}/"
    at = lambda entry: store.spec(f"{prefix}{entry}")  # noqa: E731
    with monkeypatch.context() as small:
        small.setattr(chunks_module, "CHUNK_BYTES", 1 << 20)  # 2 chunks of FROZEN, not 1
        eqxckpt.save(at("1"), {"frozen": FROZEN, "h": np.zeros(3, np.float32)})
        eqxckpt.save(at("other"), {"frozen": -FROZEN, "h": np.zeros(3, np.float32)})
    eqxckpt.save(at("2"), {"frozen": FROZEN, "h": np.ones(3, np.float32)}, base=at("1"))
    leaf = eqxckpt.open(at("2")).leaf("frozen")
    assert isinstance(leaf, StoredLeaf) and leaf.arrays is not None and leaf.seen is None
    [chunk] = [key for key in store.keys(prefix + "1/") if key.endswith("/frozen/c/1/0")]
    [other] = [key for key in store.keys(prefix + "other/") if key.endswith("/frozen/c/1/0")]
    store.put(chunk, store.get(other))  # a sound CRC-32C, other values
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eqxckpt.save(at("3"), {"frozen": FROZEN, "h": np.full(3, 2, np.float32)}, base=at("2"))
    assert any("'frozen'" in str(w.message) and "damaged" in str(w.message) for w in caught), caught
    assert np.asarray(eqxckpt.load(at("3"))["frozen"]).tobytes() == FROZEN.tobytes()


def test_bytes_put_back_around_a_check_are_never_recorded_as_checked(store, monkeypatch):
    """The outside attack on this rule: on S3 an object's ETag is its bytes' MD5, so a
    damaged chunk replaced by sound bytes while a save checked it, then damaged again, had
    the same ETag before and after the check, and the damaged bytes were recorded as
    checked and shared unread. What is recorded is the generation the check's own reads
    returned: the sound bytes', which the damaged ones do not have."""
    prefix = f"reuse-aba-{uuid.uuid4().hex[:8]}/"
    at = lambda entry: store.spec(f"{prefix}{entry}")  # noqa: E731
    eqxckpt.save(at("1"), {"frozen": FROZEN, "h": np.zeros(3, np.float32)})
    eqxckpt.save(at("other"), {"frozen": -FROZEN, "h": np.zeros(3, np.float32)})
    [chunk] = [key for key in store.keys(prefix + "1/") if "/frozen/c/" in key]
    [other] = [key for key in store.keys(prefix + "other/") if "/frozen/c/" in key]
    sound, damaged = store.get(chunk), store.get(other)
    store.put(chunk, damaged)
    checking = reuse_module.damaged_leaves

    def sound_while_checked(stored, records):  # another writer, around the check's reads
        store.put(chunk, sound)
        try:
            return checking(stored, records)
        finally:
            store.put(chunk, damaged)

    monkeypatch.setattr(reuse_module, "damaged_leaves", sound_while_checked)
    eqxckpt.save(at("2"), {"frozen": FROZEN, "h": np.ones(3, np.float32)}, base=at("1"))
    monkeypatch.setattr(reuse_module, "damaged_leaves", checking)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eqxckpt.save(at("3"), {"frozen": FROZEN, "h": np.full(3, 2, np.float32)}, base=at("2"))
    assert any("'frozen'" in str(w.message) and "damaged" in str(w.message) for w in caught), caught
    written = eqxckpt.open(at("3")).leaf("frozen")
    assert isinstance(written, StoredLeaf) and written.arrays is None
    assert np.asarray(eqxckpt.load(at("3"))["frozen"]).tobytes() == FROZEN.tobytes()
