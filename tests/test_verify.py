"""Damaged checkpoints: load refuses them naming the leaf, verify reports every problem."""

import json
import os
import shutil

import numpy as np
import pytest
from conftest import assert_trees_equal, manifest_doc

import eqxckpt
from eqxckpt._cli import main as cli

W = np.arange(48, dtype=np.float32).reshape(6, 8)


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "c"
    eqxckpt.save(path, {"model": {"w": W, "b": np.ones(8, np.float32)}, "step": 3})
    return path


def chunk(path):
    return path / "model/w/c/0/0"


def flip_byte(path):
    data = bytearray(chunk(path).read_bytes())
    data[len(data) // 2] ^= 0x01
    chunk(path).write_bytes(bytes(data))


def truncate_chunk(path):
    os.truncate(chunk(path), 10)


def delete_chunk(path):
    chunk(path).unlink()


def other_leaf_metadata(path):
    shutil.copy(path / "model/b/zarr.json", path / "model/w/zarr.json")


def metadata_without_checksum(path):
    meta = json.loads((path / "model/w/zarr.json").read_text())
    meta["codecs"] = [c for c in meta["codecs"] if c["name"] != "crc32c"]
    (path / "model/w/zarr.json").write_text(json.dumps(meta))


def metadata_other_dtype(path):
    meta = json.loads((path / "model/w/zarr.json").read_text())
    meta["data_type"] = "int32"
    (path / "model/w/zarr.json").write_text(json.dumps(meta))


LEAF_DAMAGE = [
    flip_byte,
    truncate_chunk,
    delete_chunk,
    other_leaf_metadata,
    metadata_without_checksum,
    metadata_other_dtype,
]


@pytest.mark.parametrize("damage", LEAF_DAMAGE, ids=lambda f: f.__name__)
def test_damaged_leaf_is_refused_and_reported(ckpt, damage, capsys):
    assert eqxckpt.verify(ckpt).ok
    damage(ckpt)
    with pytest.raises(eqxckpt.CorruptCheckpointError, match=r"Leaf 'model/w' is corrupt|Leaf 'model/w'"):
        eqxckpt.load(ckpt)
    with pytest.raises(eqxckpt.CorruptCheckpointError, match="model/w"):
        eqxckpt.open(ckpt)["model/w"].get()
    # other leaves still load, and a partial restore that skips the damage works
    np.testing.assert_array_equal(eqxckpt.load(ckpt, at="model/b"), np.ones(8, np.float32))
    report = eqxckpt.verify(ckpt)
    assert not report.ok and [p for p, _ in report.problems] == ["model/w"]
    assert report.arrays_checked == 1
    assert cli(["verify", str(ckpt)]) == 1
    out = capsys.readouterr().out
    assert "model/w" in out and "DAMAGED" in out


def truncate_manifest(path):
    os.truncate(path / "eqxckpt.json", 40)


def garble_manifest(path):
    raw = bytearray((path / "eqxckpt.json").read_bytes())
    raw[5:25] = b"\xff" * 20
    (path / "eqxckpt.json").write_bytes(bytes(raw))


def empty_manifest(path):
    (path / "eqxckpt.json").write_bytes(b"")


@pytest.mark.parametrize("damage", [truncate_manifest, garble_manifest, empty_manifest], ids=lambda f: f.__name__)
def test_damaged_manifest_is_refused_and_reported(ckpt, damage):
    damage(ckpt)
    with pytest.raises(eqxckpt.ManifestError, match="not valid JSON|corrupt"):
        eqxckpt.load(ckpt)
    report = eqxckpt.verify(ckpt)
    assert report.problems[0][0] == "eqxckpt.json" and not report.ok
    assert cli(["verify", str(ckpt)]) == 1


def test_verify_healthy_and_extra_files(ckpt, capsys):
    report = eqxckpt.verify(ckpt)
    assert report.ok and report.leaves == 3 and report.arrays_checked == 2 and report.bytes_checked == W.nbytes + 32
    assert cli(["verify", str(ckpt)]) == 0 and "OK" in capsys.readouterr().out
    (ckpt / "model" / "notes.txt").write_text("added later")
    report = eqxckpt.verify(ckpt)
    assert report.problems == [("model/notes.txt", "not named in the manifest (left over, or added after the save)")]


def test_verify_reads_large_leaves_in_slabs(tmp_path, monkeypatch):
    import eqxckpt._chunks as chunks_module
    import eqxckpt._stored as stored_module

    monkeypatch.setattr(chunks_module, "CHUNK_BYTES", 1024)
    monkeypatch.setattr(stored_module, "SLAB_BYTES", 4096)
    x = np.arange(100 * 64, dtype=np.float32).reshape(100, 64)
    eqxckpt.save(tmp_path / "c", {"x": x})
    assert eqxckpt.verify(tmp_path / "c").ok
    last = sorted((tmp_path / "c/x/c").iterdir(), key=lambda p: int(p.name))[-1] / "0"
    data = bytearray(last.read_bytes())
    data[-1] ^= 0xFF  # damage the last chunk's checksum
    last.write_bytes(bytes(data))
    assert [p for p, _ in eqxckpt.verify(tmp_path / "c").problems] == ["x"]


def test_verify_missing_checkpoint_is_not_found_not_damaged():
    with pytest.raises(eqxckpt.CheckpointNotFoundError, match="does not exist"):
        eqxckpt.verify("/nonexistent/ckpt")


def test_zarr_groups_are_eqxckpt_s_and_checked(tmp_path):
    eqxckpt.save(tmp_path / "c", {"model": {"layers": [{"w": np.ones(2)}]}, "step": 1})
    for group in ("zarr.json", "model/zarr.json", "model/layers/zarr.json", "model/layers/0/zarr.json"):
        assert json.loads((tmp_path / "c" / group).read_text()) == {
            "zarr_format": 3,
            "node_type": "group",
            "attributes": {},
        }
    assert eqxckpt.verify(tmp_path / "c").ok
    (tmp_path / "c" / "model" / "zarr.json").write_text(
        '{"zarr_format": 3, "node_type": "group", "attributes": {"x": 1}}'
    )
    report = eqxckpt.verify(tmp_path / "c")
    assert not report.ok and report.problems == [
        ("model/zarr.json", "a zarr group's metadata that is not what eqxckpt writes")
    ]


def test_chunks_that_pass_their_checksums_but_are_not_the_leafs_are_caught_by_its_digest(tmp_path, monkeypatch):
    """Per-chunk CRCs cannot tell a chunk swapped in from another leaf, or an older save's
    chunk put back, from the real one; each leaf's digest can: for own arrays (read whole or
    in slabs) and for packed leaves, naming exactly the leaves hit."""
    many = {f"s{i}": np.full(8, i, np.float32) for i in range(40)}  # packed
    tree = {"p": np.zeros((300, 300), np.float32), "q": np.ones((300, 300), np.float32), **many}
    eqxckpt.save(tmp_path / "c", tree)
    eqxckpt.save(tmp_path / "older", {**tree, "s3": np.full(8, -1, np.float32)})
    assert eqxckpt.verify(tmp_path / "c").ok
    p, q = tmp_path / "c/p/c/0/0", tmp_path / "c/q/c/0/0"
    p_bytes, q_bytes = p.read_bytes(), q.read_bytes()
    p.write_bytes(q_bytes)
    q.write_bytes(p_bytes)
    shutil.copy(tmp_path / "older/%packed/c/0", tmp_path / "c/%packed/c/0")
    for slab in (64 << 20, 100_000, 980):  # whole; in slabs of rows; packed leaves across slabs too
        monkeypatch.setattr("eqxckpt._stored.SLAB_BYTES", slab)
        report = eqxckpt.verify(tmp_path / "c")
        assert sorted(path for path, _ in report.problems) == ["p", "q", "s3"], report
        assert all("pass their chunks' checksums but are not the bytes saved" in why for _, why in report.problems)
        assert report.arrays_checked == len(tree) - 3


def test_a_packed_leaf_across_two_chunks_is_digested_as_its_bytes_arrive(tmp_path):
    """Most packed leaves are digested in one step; one whose bytes straddle two chunks of
    the packed array is hashed piece by piece: both agree with the save's digests, and an
    older save's chunks put back are caught in the straddling leaf and its neighbours."""
    tree = {f"s{i:02d}": np.full(60_000 // 4, i, np.float32) for i in range(80)}  # 4.8 MB, packed
    eqxckpt.save(tmp_path / "c", tree)
    eqxckpt.save(tmp_path / "older", {k: v + 1 if k in ("s68", "s69", "s70") else v for k, v in tree.items()})
    packing = eqxckpt.open(tmp_path / "c").stored.packing
    chunk = 4 << 20
    straddling = [m.path for m in packing.members if m.offset // chunk != (m.offset + m.nbytes - 1) // chunk]
    assert straddling == ["s69"]  # 60,032 bytes apart: the 70th leaf holds byte 4 MiB
    assert eqxckpt.verify(tmp_path / "c").ok
    shutil.copy(tmp_path / "older/%packed/c/1", tmp_path / "c/%packed/c/1")  # s69's tail, s70
    report = eqxckpt.verify(tmp_path / "c")
    assert sorted(path for path, _ in report.problems) == ["s69", "s70"], report
    shutil.copy(tmp_path / "older/%packed/c/0", tmp_path / "c/%packed/c/0")  # s68, s69's head
    report = eqxckpt.verify(tmp_path / "c")
    assert sorted(path for path, _ in report.problems) == ["s68", "s69", "s70"], report
    assert report.arrays_checked == 77


def shared_state(step: int) -> dict:
    """A frozen leaf with an array of its own, frozen small leaves (packed), and a leaf that
    changes every step (too large to be packed)."""
    return {
        "frozen": np.arange(131072, dtype=np.float32),
        "small": [np.full(4, i, np.float32) for i in range(40)],
        "adapter": np.full(70_000, step, np.float32),
    }


def flip_first_bit(file) -> None:
    data = bytearray(file.read_bytes())
    data[0] ^= 0x01
    file.write_bytes(bytes(data))


def test_verify_names_every_checkpoint_that_shares_a_damaged_file(tmp_path):
    """Incremental steps hard-link one file: damage to it is damage to each of them, and
    verify of any one says which others hold the same file. A step that wrote its own
    copy (incremental=False) shares nothing and is not named; neither is a leaf that
    changed."""
    run = tmp_path / "run"
    with eqxckpt.CheckpointManager(run, blocking=True, kept_copies=1) as manager:
        for step in range(3):
            manager.save(step, shared_state(step))
    with eqxckpt.CheckpointManager(run, blocking=True, incremental=False) as manager:
        manager.save(3, shared_state(3))
    for damaged in ("frozen/c/0", "%packed/c/0", "adapter/c/0"):
        flip_first_bit(run / "1" / damaged)  # 1's frozen and packed files are 0's and 2's too
    for step, others in ((0, ["1", "2"]), (1, ["0", "2"]), (2, ["0", "1"])):
        report = eqxckpt.verify(run / str(step))
        damaged = {path for path, _ in report.problems}
        assert {"frozen", "small/0", "small/39"} <= damaged and ("adapter" in damaged) == (step == 1)
        assert report.shared_with == {"frozen": others, "%packed/c/0": others} | {
            f"small/{i}": others for i in range(40)
        }
        lines = {path: (what, details) for path, what, details in report.lines()}
        assert any(", ".join(others) in detail for detail in lines["frozen"][1])
        what, details = lines["%packed/c/0"]
        assert len(f"%packed/c/0: {what}") < 100 and "fails its CRC-32C checksum" in details[0]
        assert all(len(detail) < 140 for detail in details) and ", ".join(others) in details[1]
        assert str(report).count(f"in {', '.join(others)} beside") == 2  # the frozen file, the packed chunk
    assert eqxckpt.verify(run / "3").ok and eqxckpt.verify(run / "3").shared_with == {}


def test_verify_names_every_checkpoint_that_refers_to_a_damaged_prefix(store):
    """On an object store: the steps whose manifests refer to the damaged prefix, the step
    that wrote it included while it is kept, are named; after retention deleted that step,
    the steps that still refer to its prefix are."""
    top = f"shared-{store.name}/run/"
    with eqxckpt.CheckpointManager(store.spec(top), blocking=True, kept_copies=1) as manager:
        for step in range(3):
            manager.save(step, shared_state(step))
    [key] = [k for k in store.keys(f"{top}0/") if k.endswith("/frozen/c/0")]
    data = bytearray(store.get(key))
    data[0] ^= 0x01
    store.put(key, bytes(data))
    report = eqxckpt.verify(store.spec(f"{top}1"))
    assert [path for path, _ in report.problems] == ["frozen"] and report.shared_with == {"frozen": ["0", "2"]}
    with eqxckpt.CheckpointManager(store.spec(top), blocking=True, max_to_keep=2, kept_copies=1) as manager:
        with pytest.warns(UserWarning, match=r"Leaf 'frozen' of .*run/2/.* is damaged"):
            manager.save(3, shared_state(3))  # its frozen leaf is written afresh; 0 and 1 go
    assert manager.all_steps() == [2, 3]
    report = eqxckpt.verify(store.spec(f"{top}2"))
    assert report.shared_with == {} and not report.ok  # 0 is retired; 3 did not share the damage
    assert eqxckpt.verify(store.spec(f"{top}3")).ok


def test_swapped_packed_chunks_damage_exactly_the_leaves_in_them(tmp_path):
    rng = np.random.default_rng(0)
    tree = {f"l{i:03d}": rng.standard_normal(30000).astype(np.float32) for i in range(80)}  # some straddle
    tree["bools"] = rng.integers(0, 2, 1000).astype(bool)
    tree["empty"] = np.zeros((0, 3), np.float32)
    tree["weird name-é"] = np.ones(7, np.int8)
    where = tmp_path / "ckpt"
    eqxckpt.save(where, tree)
    assert not eqxckpt.verify(where).problems
    a, b = where / "%packed/c/0", where / "%packed/c/1"
    assert a.stat().st_size == b.stat().st_size  # each passes its own CRC after the swap
    os.rename(a, tmp_path / "t")
    os.rename(b, a)
    os.rename(tmp_path / "t", b)
    chunk = a.stat().st_size - 4
    leaves = manifest_doc((where / "eqxckpt.json").read_text())["leaves"]
    expected = {
        leaf["path"]
        for leaf in leaves
        if leaf.get("offset") is not None and leaf["offset"] < 2 * chunk and np.prod(leaf["shape"]) > 0
    }
    found = {path for path, _ in eqxckpt.verify(where).problems}
    assert found == expected and "bools" in found and "empty" not in found, found ^ expected
    restored = eqxckpt.load(where, at="l079") if "l079" not in found else None
    if restored is not None:
        assert np.asarray(restored).tobytes() == tree["l079"].tobytes()


def _a_chunk_linked_to_a_users_file(tmp_path, symlink: bool = False):
    """Five steps, step 0's frozen chunk replaced by a link to a user's file outside the
    run: the run and that file."""
    run = tmp_path / "run"
    _five_steps(run)
    precious = tmp_path / "precious.txt"
    precious.write_bytes(b"user's notes")
    chunk = run / "0" / "frozen/c/0"
    chunk.unlink()
    chunk.symlink_to(precious) if symlink else os.link(precious, chunk)
    return run, precious


def _five_steps(run) -> None:
    with eqxckpt.CheckpointManager(run, max_to_keep=5, blocking=True) as manager:  # two copies (default)
        for step in range(5):
            manager.save(step, shared_state(step))


def test_repair_mends_a_flipped_bit_from_the_other_copy_in_every_sharer(tmp_path, capsys):
    """Issue #53: one bit flipped in a frozen leaf's file and in a packed chunk damages the
    kept steps sharing those files, never all of them (two copies by default);
    ``eqxckpt verify --repair RUN/`` rewrites the files in place from the other copy, so every
    sharer is mended, and every step then verifies and loads exactly."""
    run = tmp_path / "run"
    _five_steps(run)
    for damaged in ("frozen/c/0", "%packed/c/0"):
        flip_first_bit(run / "0" / damaged)
    broken = [step for step in range(5) if not eqxckpt.verify(run / str(step)).ok]
    assert 0 in broken and len(broken) < 5  # another copy stands behind the other steps
    assert cli(["verify", str(run)]) == 1
    capsys.readouterr()
    assert cli(["verify", "--repair", str(run)]) == 0
    printed = capsys.readouterr().out
    assert "0/frozen: mended from its twin in" in printed and "0/%packed: mended" in printed
    for step in range(5):
        assert eqxckpt.verify(run / str(step)).ok
        assert_trees_equal(eqxckpt.load(run / str(step), shared_state(step)), shared_state(step))
    assert os.stat(run / "0/frozen/c/0").st_ino == os.stat(run / f"{broken[-1]}/frozen/c/0").st_ino  # in place


def test_repair_mends_nothing_from_a_twin_that_does_not_verify(tmp_path):
    """Both copies damaged (in different chunks): neither is taken to mend the other, both
    stay listed, and no file changes; a leaf with no twin (changed every step) stays damaged
    and is named."""
    run = tmp_path / "run"
    _five_steps(run)
    copies = sorted({os.stat(run / str(s) / "frozen/c/0").st_ino: s for s in range(5)}.values())
    assert len(copies) == 2
    for step in copies:
        flip_first_bit(run / str(step) / "frozen/c/0")
    flip_first_bit(run / "4" / "adapter/c/0")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    for step in range(5):
        report = eqxckpt.verify(run / str(step), repair=True)
        assert report.mended == [] and "frozen" in {path for path, _ in report.problems}
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    assert "adapter" in {path for path, _ in eqxckpt.verify(run / "4", repair=True).problems}


@pytest.mark.parametrize("link", ["symlink", "hard link", "hard link, and an alias of the step"])
def test_repair_never_writes_to_a_file_outside_the_run(tmp_path, link):
    """A damaged chunk replaced by a symlink to a user's file outside the run, or (the
    sixteenth outside attack) a hard link to one: rewriting it in place would change that
    file. Refused: the file is untouched and the leaf is still listed damaged. (The
    eighteenth: a symlink ``latest -> 0`` in the run counted the link twice, so it passed.)"""
    run, precious = _a_chunk_linked_to_a_users_file(tmp_path, symlink=link == "symlink")
    if "alias" in link:
        (run / "latest").symlink_to("0")
    report = eqxckpt.verify(run / "0", repair=True)
    assert "frozen" in {path for path, _ in report.problems} and report.mended == []
    assert [path for path, _ in report.unmended] == ["frozen"] and precious.read_bytes() == b"user's notes"


def test_repair_takes_no_twin_of_another_layout_where_the_zarr_json_is_damaged(tmp_path, monkeypatch):
    """The sixteenth outside attack: step 2 links step 1's chunk files, and its own zarr.json
    is damaged; step 0 holds the same values in two chunks. Mending step 2 from step 0 would
    rewrite the chunk file step 1 shares into another layout: the twin must be laid out as
    step 2's chunk files are (step 1), and step 1 stays whole."""
    import eqxckpt._chunks as chunks_module

    run, values = tmp_path / "run", np.arange(131072, dtype=np.float32)
    monkeypatch.setattr(chunks_module, "CHUNK_BYTES", 1 << 18)
    eqxckpt.save(run / "0", {"w": values})  # two chunks
    monkeypatch.undo()
    eqxckpt.save(run / "1", {"w": values})  # one chunk
    eqxckpt.save(run / "2", {"w": values}, base=run / "1")  # links step 1's files
    assert len(list((run / "0" / "w" / "c").iterdir())) == 2
    metadata = run / "2" / "w" / "zarr.json"
    damaged = metadata.read_bytes()[:-5]
    metadata.unlink()  # its own file now (step 1's is intact)
    metadata.write_bytes(damaged)
    assert cli(["verify", "--repair", str(run)]) == 0
    for step in range(3):
        assert eqxckpt.verify(run / str(step)).ok
        np.testing.assert_array_equal(eqxckpt.load(run / str(step))["w"], values)
    assert os.stat(run / "1/w/c/0").st_ino == os.stat(run / "2/w/c/0").st_ino


def _while_repairing(monkeypatch, act) -> None:
    """Make ``act()`` run once, just after repair has found and checked a twin and before it
    writes anything (another process's save or retention at that instant)."""
    import eqxckpt._check._repair as repair_module

    found_twin = repair_module._twin_record
    acted: list[bool] = []

    def then_act(*args):
        found = found_twin(*args)
        if found is not None and not acted:
            acted.append(True)
            act()
        return found

    monkeypatch.setattr(repair_module, "_twin_record", then_act)


@pytest.mark.parametrize("same_values", [False, True])
def test_repair_never_writes_into_a_checkpoint_that_replaced_the_damaged_one(tmp_path, monkeypatch, same_values):
    """The seventeenth outside attack: step 0 is replaced (``overwrite=True``) after repair
    checked its twin; repair wrote the twin's file into the new step 0 by its path,
    damaging it. Repair writes only in the directory it opened, says it was replaced, and
    the new step 0 is untouched."""
    run = tmp_path / "run"
    _five_steps(run)
    chunk = run / "0" / "frozen/c/0"
    damaged = bytearray(chunk.read_bytes())
    damaged[0] ^= 1
    chunk.unlink()  # its own file: the other steps of its group stay sound
    chunk.write_bytes(bytes(damaged))
    new = shared_state(0) | {"frozen": np.arange(131072, dtype=np.float32) + (0 if same_values else 1)}
    _while_repairing(monkeypatch, lambda: eqxckpt.save(run / "0", new, overwrite=True))
    report = eqxckpt.verify(run / "0", repair=True)
    assert report.mended == [] and [path for path, _ in report.unmended] == ["frozen"]
    assert "replaced or deleted while it was mended" in report.unmended[0][1]
    assert eqxckpt.verify(run / "0").ok
    assert_trees_equal(eqxckpt.load(run / "0"), new)


@pytest.mark.parametrize("damage", ["truncated", "deleted"])
def test_repair_mends_a_chunk_file_cut_short_or_gone(tmp_path, damage):
    """The eighteenth outside attack: a chunk file truncated or deleted (its zarr.json
    intact) was never mended, "no twin" said: the leaf's layout was read with its files'
    size checks. Its layout is what its zarr.json declares; the file is written again."""
    run = tmp_path / "run"
    _five_steps(run)
    chunk = run / "0" / "frozen/c/0"
    good = chunk.read_bytes()
    chunk.unlink()  # its own file (its twin in the other group stays whole)
    if damage == "truncated":
        chunk.write_bytes(good[: len(good) // 2])
    report = eqxckpt.verify(run / "0", repair=True)
    assert report.ok and [path for path, _ in report.mended] == ["frozen"], report
    assert chunk.read_bytes() == good


def test_repair_never_copies_from_a_twin_replaced_while_it_is_read(tmp_path, monkeypatch):
    """The nineteenth outside attack: step 0's leaf (4 chunks) is damaged in one chunk, its
    other chunks shared with step 2; step 1, the twin, is replaced with other values after
    it was checked. Repair read the new files by path and rewrote step 0's chunks, and so
    step 2's, with them. A twin is read as it was checked, or not at all."""
    import eqxckpt._chunks as chunks_module

    run, values = tmp_path / "run", np.arange(131072, dtype=np.float32)
    monkeypatch.setattr(chunks_module, "CHUNK_BYTES", 1 << 17)  # four chunks
    eqxckpt.save(run / "0", {"w": values})
    eqxckpt.save(run / "1", {"w": values})
    eqxckpt.save(run / "2", {"w": values}, base=run / "0")  # links step 0's files
    chunk = run / "0" / "w/c/0"
    damaged = bytearray(chunk.read_bytes())
    damaged[0] ^= 1
    chunk.unlink()  # step 0's own file now: step 2 shares the other three
    chunk.write_bytes(bytes(damaged))
    _while_repairing(monkeypatch, lambda: eqxckpt.save(run / "1", {"w": values + 1}, overwrite=True))
    report = eqxckpt.verify(run / "0", repair=True)
    assert eqxckpt.verify(run / "2").ok  # untouched
    np.testing.assert_array_equal(eqxckpt.load(run / "2")["w"], values)
    if report.mended:  # from step 2, the one twin left
        assert report.ok and [twin for _, twin in report.mended] == [str(run / "2")]
        np.testing.assert_array_equal(eqxckpt.load(run / "0")["w"], values)


def test_repair_never_counts_a_bind_mounted_step_as_another(tmp_path):
    """The nineteenth outside attack: step 0 also mounted as ``run/9`` (a bind mount) made
    a hard link to a user's file look like two links inside the run. Each directory is
    counted once: refused, the user's file untouched."""
    import subprocess

    run, precious = _a_chunk_linked_to_a_users_file(tmp_path)
    (run / "9").mkdir()
    if subprocess.run(["mount", "--bind", str(run / "0"), str(run / "9")], capture_output=True).returncode:
        (run / "9").rmdir()
        pytest.skip("bind mounts need CAP_SYS_ADMIN")
    try:
        report = eqxckpt.verify(run / "0", repair=True)
    finally:
        subprocess.run(["umount", "-l", str(run / "9")], check=False)
    assert report.mended == [] and precious.read_bytes() == b"user's notes"


def test_repair_of_a_local_copy_of_an_object_store_step(s3, tmp_path):
    """The nineteenth outside attack: a step copied from S3 to a disk keeps its arrays in
    its ``%arrays.<hex>/`` directory; repair wrote the mended file beside it (at the key as
    the arrays name it), so the leaf stayed damaged and stray files stayed. It is mended
    where it is, and nothing else is written."""
    from conftest import ObjectStore

    endpoint, client = s3
    store, top = ObjectStore("s3", endpoint, client), "repair-copy/run/"
    with eqxckpt.CheckpointManager(store.spec(top), max_to_keep=5, blocking=True) as manager:
        for step in range(2):  # two copies: each step its own prefix
            manager.save(step, shared_state(step))
    local = tmp_path / "copy"
    for key in store.keys(top):
        (local / key[len(top) :]).parent.mkdir(parents=True, exist_ok=True)
        (local / key[len(top) :]).write_bytes(store.get(key))
    [chunk] = (local / "0").rglob("frozen/c/0")
    assert chunk.parent.parent.parent.name.startswith("%arrays.")
    flip_first_bit(chunk)
    files = sorted(local.rglob("*"))
    report = eqxckpt.verify(local / "0", repair=True)
    assert report.ok and [path for path, _ in report.mended] == ["frozen"], report
    assert sorted(local.rglob("*")) == files
