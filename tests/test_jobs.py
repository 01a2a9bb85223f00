"""`_write._jobs`: a save's jobs and their digests; a `jax.Array` hashed once per object."""

import gc

import jax.numpy as jnp
import numpy as np
import pytest

import eqxckpt
from eqxckpt._write import _jobs


@pytest.fixture
def hashed(monkeypatch) -> list[list]:
    """The digest fields of every leaf hashed by a save's `digested`."""
    calls: list[list] = []
    digest = _jobs.digest

    def counted(fields, data):
        calls.append(fields)
        return digest(fields, data)

    monkeypatch.setattr(_jobs, "digest", counted)
    return calls


def test_a_jax_array_is_hashed_once_per_object_and_a_numpy_array_every_save(tmp_path, hashed):
    frozen = jnp.arange(100_000, dtype=jnp.float32)
    mutable = np.arange(100_000, dtype=np.int32)
    tree = {"frozen": frozen, "mutable": mutable}
    eqxckpt.save(tmp_path / "0", tree)  # hashed beside the writes (no base)
    hashed.clear()
    eqxckpt.save(tmp_path / "1", tree, base=tmp_path / "0")
    assert sorted(f[1] for f in hashed) == ["float32", "int32"]  # the first save with a base hashes both
    hashed.clear()
    mutable[7] = -1  # in place: the digest must see it
    eqxckpt.save(tmp_path / "2", tree, base=tmp_path / "1")
    assert [f[1] for f in hashed] == ["int32"]
    loaded = eqxckpt.load(tmp_path / "2")
    assert loaded["mutable"][7] == -1 and np.array_equal(loaded["frozen"], np.arange(100_000, dtype=np.float32))


def test_another_jax_array_is_hashed_even_with_the_same_values_or_address(tmp_path, hashed):
    eqxckpt.save(tmp_path / "0", {"w": jnp.zeros(100_000, jnp.float32)})
    hashed.clear()
    for step in range(1, 4):
        # Each step a new object (which may reuse a freed one's id): hashed, never taken for it.
        w = jnp.full(100_000, step, jnp.float32)
        eqxckpt.save(tmp_path / str(step), {"w": w}, base=tmp_path / str(step - 1))
        assert np.array_equal(eqxckpt.load(tmp_path / str(step))["w"], np.full(100_000, step, np.float32))
        del w
        gc.collect()
    assert len(hashed) == 3
    assert not _jobs.JAX_DIGESTS._known or all(ref() is not None for ref, _, _ in _jobs.JAX_DIGESTS._known.values())


def test_the_same_array_under_other_digest_fields_is_hashed_again(tmp_path, hashed):
    w = jnp.arange(100_000, dtype=jnp.uint8)
    eqxckpt.save(tmp_path / "0", {"w": w})
    hashed.clear()
    eqxckpt.save(tmp_path / "1", {"w": w}, base=tmp_path / "0")
    eqxckpt.save(tmp_path / "2", {"w": w.reshape(1000, 100)}, base=tmp_path / "1")  # another object, shape
    eqxckpt.save(tmp_path / "3", {"w": w}, base=tmp_path / "2")  # the first again: known
    assert [f[2] for f in hashed] == [[100_000], [1000, 100]]
    assert eqxckpt.load(tmp_path / "3")["w"].shape == (100_000,)
