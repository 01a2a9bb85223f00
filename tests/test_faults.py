"""Real resource faults in child processes: a file-size limit (as a full disk would),
a read-only target, and two processes saving to one place at once."""

import ctypes
import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import eqxckpt

SMALL = {"w": np.arange(10, dtype=np.float32), "step": 1}


def run_child(script: str, **kwargs) -> dict:
    """Run ``script`` in a fresh interpreter; it prints one JSON line as its result."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        **kwargs,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.multiprocess
def test_file_size_limit_fails_cleanly_and_keeps_the_previous_checkpoint(tmp_path):
    eqxckpt.save(tmp_path / "ckpt", SMALL)
    outcome = run_child(f"""
        import json, resource, signal
        import numpy as np, eqxckpt
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        big = {{"w": np.ones(1 << 20, np.float32), "step": 2}}  # 4 MiB, over the 1 MiB limit
        out = {{}}
        for blocking in (True, False):
            try:
                eqxckpt.save({str(tmp_path / "ckpt")!r}, big, overwrite=True, blocking=blocking).wait()
                out[str(blocking)] = "saved"
            except eqxckpt.CheckpointWriteError as e:
                out[str(blocking)] = str(e)
        print(json.dumps(out))
    """)
    for message in outcome.values():
        assert "File too large" in message and "Writing leaf 'w' failed" in message and "intact" in message, message
    restored = eqxckpt.load(tmp_path / "ckpt", SMALL)
    np.testing.assert_array_equal(restored["w"], SMALL["w"])
    assert os.listdir(tmp_path) == ["ckpt"]  # no temporary directory, no partial checkpoint


def _drop_privilege_to_ignore_permissions() -> None:
    """In the child, before exec: root ignores file modes unless it loses these
    capabilities (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER)."""
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        for capability in (1, 2, 3):
            if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.mark.multiprocess
@pytest.mark.filterwarnings("ignore:os.fork")  # preexec_fn forks; the child execs at once
def test_read_only_target_fails_cleanly(tmp_path):
    target = tmp_path / "ro"
    target.mkdir()
    eqxckpt.save(target / "ckpt", SMALL)
    before = sorted(os.listdir(target))
    for path in (target, target / "ckpt"):
        path.chmod(0o555)
    try:
        outcome = run_child(
            f"""
            import json
            import numpy as np, eqxckpt
            out = {{}}
            for name, overwrite in (("ckpt", True), ("new", False)):
                try:
                    eqxckpt.save({str(target)!r} + "/" + name, {{"w": np.zeros(3)}}, overwrite=overwrite)
                    out[name] = "saved"
                except eqxckpt.CheckpointWriteError as e:
                    out[name] = str(e)
            out["load"] = eqxckpt.load({str(target / "ckpt")!r})["w"].tolist()  # reading needs no write access
            print(json.dumps(out))
        """,
            preexec_fn=_drop_privilege_to_ignore_permissions,
        )
    finally:
        for path in (target, target / "ckpt"):
            path.chmod(0o755)
    assert "Permission denied" in outcome["ckpt"] and "Permission denied" in outcome["new"], outcome
    assert outcome["load"] == SMALL["w"].tolist()
    assert sorted(os.listdir(target)) == before
    np.testing.assert_array_equal(eqxckpt.load(target / "ckpt", SMALL)["w"], SMALL["w"])


RACER = """
import json, os, sys, time
import numpy as np, eqxckpt
directory, name, value, overwrite = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4] == "1"
tree = {{f"leaf{{i}}": np.full((256, 1024), value, np.float32) for i in range(8)}}
while not os.path.exists(os.path.join(directory, "go")):
    time.sleep(0.001)
try:
    eqxckpt.save(os.path.join(directory, name), tree, overwrite=overwrite)
    print(json.dumps("saved"))
except eqxckpt.CheckpointExistsError as e:
    print(json.dumps("exists: " + str(e)))
"""


@pytest.mark.multiprocess
def test_two_processes_saving_to_one_place_give_one_complete_checkpoint(tmp_path):
    for round_, overwrite in enumerate([True, True, True, False, False]):
        directory = tmp_path / f"round{round_}"
        directory.mkdir()
        racers = [
            subprocess.Popen(
                [sys.executable, "-c", RACER.format(), str(directory), "ckpt", str(v), str(int(overwrite))],
                stdout=subprocess.PIPE,
                text=True,
                env=dict(os.environ, JAX_PLATFORMS="cpu"),
            )
            for v in (1.0, 2.0)
        ]
        time.sleep(1.5)  # let both import and wait for the start signal
        (directory / "go").touch()
        outcomes = [json.loads(r.communicate(timeout=120)[0].strip().splitlines()[-1]) for r in racers]
        restored = eqxckpt.load(directory / "ckpt")
        values = {float(np.unique(leaf)[0]) for leaf in restored.values()}
        assert len(values) == 1 and all(np.unique(leaf).size == 1 for leaf in restored.values())  # never a mix
        if overwrite:
            assert outcomes == ["saved", "saved"]
        else:  # exactly one wins; the other is told, and its data is discarded
            assert sorted(o.split(":")[0] for o in outcomes) == ["exists", "saved"]
            assert values == {[1.0, 2.0][outcomes.index("saved")]}
        assert sorted(os.listdir(directory)) == ["ckpt", "go"]


@pytest.mark.multiprocess
@pytest.mark.filterwarnings("ignore:os.fork")
def test_retention_without_permission_keeps_the_step_and_says_so(tmp_path):
    run = tmp_path / "run"
    with eqxckpt.CheckpointManager(run) as manager:
        manager.save(0, SMALL)
    (run / "0" / "w").chmod(0o555)  # its files cannot be removed
    try:
        outcome = run_child(
            f"""
            import json
            import numpy as np, eqxckpt
            manager = eqxckpt.CheckpointManager({str(run)!r}, max_to_keep=1)
            try:
                manager.save(1, {{"w": np.ones(10, np.float32), "step": 2}})
                manager.wait()
                out = "deleted"
            except eqxckpt.CheckpointWriteError as e:
                out = str(e)
            print(json.dumps(out))
        """,
            preexec_fn=_drop_privilege_to_ignore_permissions,
        )
    finally:
        (run / "0" / "w").chmod(0o755)
    assert "Deleting step 0" in outcome and "Permission denied" in outcome and str(run / "0" / "w") in outcome, outcome
    assert sorted(os.listdir(run)) == ["0", "1"]  # nothing half-deleted, nothing hidden left behind
    assert eqxckpt.verify(run / "0").ok and eqxckpt.CheckpointManager(run).all_steps() == [0, 1]


@pytest.mark.multiprocess
@pytest.mark.filterwarnings("ignore:os.fork")
def test_an_unreadable_checkpoint_is_a_clear_error_in_every_format(tmp_path):
    import safetensors.numpy as stn

    locked = tmp_path / "locked"
    locked.mkdir()
    eqxckpt.save(locked / "ckpt", SMALL)
    stn.save_file({"w": np.ones(2, np.float32)}, str(locked / "model.safetensors"))
    locked.chmod(0o311)  # listed by nobody, entered by name
    (locked / "ckpt").chmod(0o000)
    try:
        outcome = run_child(
            f"""
            import json, eqxckpt
            out = {{}}
            for name in ("ckpt", "model.safetensors"):
                try:
                    eqxckpt.open({str(locked)!r} + "/" + name)
                    out[name] = "opened"
                except eqxckpt.CheckpointError as e:
                    out[name] = type(e).__name__ + ": " + str(e)
            print(json.dumps(out))
        """,
            preexec_fn=_drop_privilege_to_ignore_permissions,
        )
    finally:
        (locked / "ckpt").chmod(0o755)
        locked.chmod(0o755)
    assert outcome["ckpt"].startswith("CheckpointNotFoundError") and "Permission denied" in outcome["ckpt"], outcome
    assert outcome["model.safetensors"] == "opened" or "Permission denied" in outcome["model.safetensors"]
