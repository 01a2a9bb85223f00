"""Attack 10: object-store chunk reads in budget-bounded groups (`KvChunkFiles.reading`):
the chunk object replaced between two groups of ranged reads, with a 1-byte budget."""

import numpy as np
import pytest
from conftest import BUCKET, ObjectStore

import eqxckpt
from eqxckpt._storage import _backend


@pytest.mark.parametrize("swap", ["other-save", "same-bytes"])
def test_a_chunk_replaced_between_groups_is_never_returned_as_a_mix(tmp_path, s3, monkeypatch, swap):
    """A 3 MiB leaf (one chunk) read with host_memory_budget=1: three groups of 1 MiB. Before
    the second group, its chunk object is replaced by the chunk of another save of the same
    leaf (valid on its own) or rewritten with its own bytes. The load returns the first
    save's values exactly, or refuses; never a mix."""
    store = ObjectStore("s3", *s3)
    prefix = f"a10-groups-{swap}-{tmp_path.name}/"
    first = np.arange(3 << 18, dtype=np.float32)
    second = -first - 1
    eqxckpt.save(store.spec(prefix + "a/"), {"w": first})
    eqxckpt.save(store.spec(prefix + "b/"), {"w": second})
    [chunk_a] = [k for k in store.keys(prefix + "a/") if "/w/c/" in k]
    [chunk_b] = [k for k in store.keys(prefix + "b/") if "/w/c/" in k]
    replacement = store.get(chunk_b if swap == "other-save" else chunk_a)
    original, starts = _backend.read_parts, []

    def read_parts(kv, key, size, part_bytes, start=0, stop=None):
        if key.endswith("w/c/0") and start > 0 and len(starts) == 1:
            store.client.put_object(Bucket=BUCKET, Key=chunk_a, Body=replacement)
        if key.endswith("w/c/0"):
            starts.append((start, stop))
        return original(kv, key, size, part_bytes, start, stop)

    monkeypatch.setattr(_backend, "read_parts", read_parts)
    try:
        restored = np.asarray(eqxckpt.load(store.spec(prefix + "a/"), host_memory_budget=1)["w"])
    except eqxckpt.CheckpointError as e:
        assert "w" in str(e) and "replaced" in str(e), e
        restored = None
    # Read in groups: 1 MiB, 1 MiB, 1 MiB, then its 4-byte checksum (stopped at the second if refused).
    assert starts[:2] == [(0, 1 << 20), (1 << 20, 2 << 20)], starts
    if restored is not None:
        assert restored.tobytes() == first.tobytes()
