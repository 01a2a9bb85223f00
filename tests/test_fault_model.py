"""A model-based fault harness: hypothesis drives saves, deletions, bit rot, killed and
stopped writers, preemption and users' own files in one run directory (a local disk,
S3 on moto, Cloud Storage on fake-gcs-server), against a reference model of what each
step must hold. After every rule:

- every load of a step returns exactly the model's values or raises a `CheckpointError`,
  and a step the model says is undamaged loads exactly;
- `eqxckpt.verify` flags exactly the damaged steps;
- nothing eqxckpt did not write is changed or deleted;
- a fresh `CheckpointManager` lists exactly the committed steps, less those whose manifest
  was damaged, each named in its warning.

The model decides damage from the outside, at the moment of the fault: a fault damages
every step that holds the file (same inode on a local disk, same key on an object store,
where a step holds its own keys and those its manifest refers to). A step saved after a
fault is undamaged: whatever it takes from an earlier step must be sound.

SIGSTOP past a lease runs on S3 only: local disks have no leases (a stopped writer keeps
its lock), and fake-gcs-server ignores the preconditions leases rely on; so does SIGTERM
with a stalled store (a proxy that stops answering).

Other tools act on the run too: they delete a whole step, a prefix of one (a base that
later incremental steps refer to, a retired one), copy a step under a new number, and put
files inside steps. A reader in another process loads and slices steps while saves run.
A multi-process job (`test_fault_model_across_processes`) is killed at random instants.
"""

import contextlib
import dataclasses
import json
import os
import pathlib
import posixpath
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterator

import numpy as np
import pytest
from conftest import WORKERS, PausableProxy, manifest_doc, s3_spec
from fault_model_worker import train_version, tree  # pyright: ignore[reportMissingImports]
from hypothesis import HealthCheck, note, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

import eqxckpt
from eqxckpt import ManifestError
from eqxckpt._storage import resolve
from eqxckpt._stored import unwritten_at

# The stalled-store rule's grace period, and what it may take beyond twice that.
GRACE_S = 1.0
GRACE_SLACK_S = 8.0

STEP_NAME = re.compile(r"^(0|[1-9][0-9]*)$")
# Objects eqxckpt reads only for their presence or protocol, not a step's data.
NOT_DATA = {"eqxckpt.lease.json", "eqxckpt.commit.json", "%doomed"}
# How long a child writer's lease lasts (so that one killed or stopped is soon abandoned).
LEASE_S = 1.0

STEPS = st.integers(0, 5)
# When a writer child is signalled: at its k-th progress report, or after a delay.
WHEN = st.one_of(st.tuples(st.just("report"), st.integers(0, 4)), st.tuples(st.just("delay"), st.floats(0.0, 1.5)))
VERSIONS = st.integers(0, 3)


# Choices among what exists are drawn as indices (taken modulo how many there are), and
# every rule draws the same whatever the state: a run whose timing differs (a killed
# writer that did or did not commit) replays as the same choices, not as a flaky strategy.
INDEX = st.integers(0, 2**16)


def same_values(got: dict, want: dict) -> bool:
    """Same leaves, bit for bit (a scalar as the type it was saved as)."""
    if not isinstance(got, dict) or sorted(got) != sorted(want):
        return False
    for name, value in want.items():
        if isinstance(value, dict):
            if not same_values(got[name], value):
                return False
        elif not isinstance(value, np.ndarray):
            if type(got[name]) is not type(value) or np.asarray(got[name]).tobytes() != np.asarray(value).tobytes():
                return False
        else:
            x = np.asarray(got[name])
            if x.dtype != value.dtype or x.shape != value.shape or x.tobytes() != value.tobytes():
                return False
    return True


# -- where the run is, reached from the outside ---------------------------------------------


class LocalRun:
    """A run directory on a local disk: files, identified by inode."""

    name = "local"

    def __init__(self, root: pathlib.Path):
        self.run = root / "run"

    def location(self):
        return str(self.run)

    def step(self, number: int):
        return str(self.run / str(number))

    def keys(self) -> list[str]:
        found = []
        for directory, _, files in os.walk(self.run):
            for name in files:
                found.append(os.path.relpath(os.path.join(directory, name), self.run))
        return sorted(found)

    def read(self, key: str) -> bytes | None:
        try:
            return (self.run / key).read_bytes()
        except FileNotFoundError:
            return None

    def write(self, key: str, body: bytes, keep_mtime: bool = False) -> None:
        """In place: every hard link to the file sees the change, as bit rot would.
        ``keep_mtime``: then set its modification time back (its change time still moves)."""
        path = self.run / key
        path.parent.mkdir(parents=True, exist_ok=True)
        before = os.stat(path) if path.exists() else None
        with open(path, "r+b" if path.exists() else "wb") as f:
            f.write(body)
            f.truncate()
        if keep_mtime and before is not None:
            os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))

    def identity(self, key: str):
        st_ = os.stat(self.run / key)
        return (st_.st_dev, st_.st_ino)

    def held(self, number: int, keys: list[str]) -> set:
        return {self.identity(k) for k in keys if k.startswith(f"{number}/")}

    def refers(self, number: int, keys: list[str]) -> set[str]:
        """The keys (not files) a step reads: its own (others' are hard links)."""
        return {k for k in keys if k.startswith(f"{number}/")}

    def prefixes(self, keys: list[str], retired: bool) -> list[str]:
        """What a tool may delete inside a step: a leaf's directory (none is retired here)."""
        leaves = {k.rsplit("/", 1)[0] for k in keys if re.match(r"^[^/]+/[^/]+/zarr.json$", k)}
        return [] if retired else sorted(p for p in leaves if STEP_NAME.match(p.split("/")[0]))

    def remove(self, prefix: str) -> list[str]:
        """``rm -r`` of a directory: the keys it held."""
        gone = [k for k in self.keys() if k.startswith(prefix + "/")]
        shutil.rmtree(self.run / prefix, ignore_errors=True)
        return gone

    def copy(self, source: int, to: int) -> None:
        shutil.copytree(self.run / str(source), self.run / str(to), symlinks=True)


class StoreRun:
    """A run under a prefix of an object store: objects, identified by key. A step holds
    its own keys and the keys of the leaves its manifest refers to in another prefix."""

    def __init__(self, store, prefix: str):
        self.store, self.name = store, store.name
        self.top = f"{prefix}run/"

    def location(self):
        return self.store.spec(self.top)

    def step(self, number: int):
        return self.store.spec(f"{self.top}{number}/")

    def keys(self) -> list[str]:
        return [key[len(self.top) :] for key in self.store.keys(self.top)]

    def read(self, key: str) -> bytes | None:
        try:
            return self.store.get(self.top + key)
        except Exception:  # noqa: BLE001 - boto's NoSuchKey or urllib's 404: the object is gone
            return None

    def write(self, key: str, body: bytes, keep_mtime: bool = False) -> None:
        self.store.put(self.top + key, body)  # (an object has no time to set back)

    def identity(self, key: str):
        return key

    def held(self, number: int, keys: list[str]) -> set:
        own = {k for k in keys if k.startswith(f"{number}/")}
        try:
            manifest = manifest_doc(self.read(f"{number}/eqxckpt.json") or b"")
            leaves = [leaf for leaf in manifest["leaves"] if isinstance(leaf, dict) and "arrays" in leaf]
            prefixes = [posixpath.normpath(f"{number}/{leaf['arrays']}/{leaf['location']}") + "/" for leaf in leaves]
        except (ValueError, KeyError, TypeError, IndexError, AttributeError, ManifestError):
            prefixes = []  # a damaged manifest refers to nothing
        return own | {k for k in keys for p in prefixes if k.startswith(p)}

    refers = held

    def prefixes(self, keys: list[str], retired: bool) -> list[str]:
        """Saves' own prefixes (``<step>/%arrays.<hex>``): those marked retired, or the others."""
        names = {"/".join(k.split("/")[:2]) for k in keys if re.match(r"^[^/]+/%arrays\.[0-9a-f]{32}/", k)}
        names = sorted(p for p in names if STEP_NAME.match(p.split("/")[0]))  # not a user's copy (``007``)
        return [p for p in names if (f"{p}/%retired" in keys) == retired]

    def remove(self, prefix: str) -> list[str]:
        gone = [k for k in self.keys() if k.startswith(prefix + "/")]
        for key in gone:
            self.store.delete(self.top + key)
        return gone

    def copy(self, source: int, to: int) -> None:
        for key in self.keys():
            if key.startswith(f"{source}/") and not key.endswith("eqxckpt.lease.json"):
                self.write(f"{to}/{key.split('/', 1)[1]}", self.read(key) or b"")


# -- the model ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Model:
    """What each step must hold. ``versions``: every step whose manifest exists, and the
    values it was saved with (`tree`). ``damaged``: certainly damaged data (verify flags it,
    a manager lists it); ``broken``: a manifest changed in any byte (its CRC-32C covers
    them all: a manager skips the step, warning); ``suspect``: an array's ``zarr.json``
    changed into other valid JSON, which may be harmless (it loads exactly or raises; verify passing it means it loads exactly);
    ``listed``: the suspects a manager was seen to list. ``foreign``: users' files."""

    versions: dict[int, int] = dataclasses.field(default_factory=dict)
    damaged: set[int] = dataclasses.field(default_factory=set)
    broken: set[int] = dataclasses.field(default_factory=set)
    suspect: set[int] = dataclasses.field(default_factory=set)
    listed: set[int] = dataclasses.field(default_factory=set)
    foreign: dict[str, bytes] = dataclasses.field(default_factory=dict)
    # Users' files put inside a step directory: where they were, or (the step deleted or
    # replaced since) kept as they were in ``<step>.kept-<hex>`` or ``<step>.replaced-<hex>``.
    inside: dict[str, bytes] = dataclasses.field(default_factory=dict)
    # Steps that refer to a prefix another tool deleted: a manager skips them, its warning
    # naming the step and the prefix (``../<step>/%arrays.<hex>``).
    missing: dict[int, set[str]] = dataclasses.field(default_factory=dict)

    def saved(self, number: int, version: int) -> None:
        """A step committed afresh: whole, whatever it held before."""
        self.versions[number] = version
        for flags in (self.damaged, self.broken, self.suspect, self.listed):
            flags.discard(number)
        self.missing.pop(number, None)

    def gone(self, number: int) -> None:
        self.versions.pop(number, None)
        for flags in (self.damaged, self.broken, self.suspect, self.listed):
            flags.discard(number)
        self.missing.pop(number, None)

    def clean(self, number: int) -> bool:
        return number in self.versions and number not in self.damaged | self.broken | self.suspect

    def manager_steps(self) -> set[int]:
        """The steps a manager lists: committed, less broken manifests and unlisted suspects."""
        return set(self.versions) - self.broken - (self.suspect - self.listed)


def classify(key: str, read) -> str | None:
    """What a stored file is to a step: ``manifest``, ``metadata`` (an array's zarr.json),
    ``chunk``, or None (group metadata, protocol objects: not a step's data). ``read``
    gives a file's bytes (only a zarr.json's are needed)."""
    parts = key.split("/")
    if not STEP_NAME.match(parts[0]) or parts[-1] in NOT_DATA or "%holds" in parts:
        return None
    if parts[-1] == "eqxckpt.json":
        return "manifest" if len(parts) == 2 else None
    if parts[-1] == "zarr.json":
        try:
            return "metadata" if json.loads(read(key) or b"").get("node_type") == "array" else None
        except (ValueError, AttributeError):
            return None  # damaged already
    return "chunk" if "c" in parts[1:-1] or parts[-1] == "c" else None


def effect(kind: str, before: bytes, after: bytes) -> str | None:
    """What changing a file does to the steps that hold it: ``damaged``, ``broken`` (a
    changed manifest), ``suspect`` (other valid JSON), or None (the same JSON)."""
    if kind == "chunk":
        return "damaged"  # its CRC-32C covers every byte; its size is known
    if kind == "manifest":
        return "broken"  # so does its CRC-32C (and a change is never to the same bytes)
    try:
        same = json.loads(after) == json.loads(before)
    except (ValueError, RecursionError):
        return "damaged"
    return None if same else "suspect"


def quiet_manager(location, **kwargs) -> tuple[eqxckpt.CheckpointManager, list[str]]:
    """A fresh manager on the run (which cleans up what interrupted saves left) and its warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager = eqxckpt.CheckpointManager(location, **kwargs)
    return manager, [str(w.message) for w in caught]


@contextlib.contextmanager
def worker(job: dict) -> Iterator[subprocess.Popen]:
    """A child running `fault_model_worker.py` on ``job`` (its lease short); killed on the
    way out if still running, whatever the rule asserted."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", EQXCKPT_LEASE_TIMEOUT_S=str(LEASE_S))
    child = subprocess.Popen(
        [sys.executable, str(WORKERS / "fault_model_worker.py"), json.dumps(job)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        yield child
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def is_stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


class DroppingProxy(PausableProxy):
    """`PausableProxy` whose `drop` closes every connection without forwarding what it
    holds: a paused request is never delivered after the test looked."""

    dropped = False

    def drop(self) -> None:
        self.dropped = True
        self.close()

    def _pump(self, source, sink) -> None:
        try:
            while data := source.recv(65536):
                self._running.wait()
                if self.dropped:
                    break
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    end.close()


class FaultModel(RuleBasedStateMachine):
    """The machine; `make_run` (a fresh run per example) and `children` (how many child
    processes an example may start) are set by each test."""

    @classmethod
    def make_run(cls) -> "LocalRun | StoreRun":
        raise NotImplementedError

    children = 1

    def __init__(self):
        super().__init__()
        self.where = self.make_run()
        self.model = Model()
        self.started = 0
        self.rotted: dict = {}  # each file rotted (by identity): its bytes since

    # -- saving and deleting ---------------------------------------------------------------

    @rule(number=STEPS, version=VERSIONS, keep=st.sampled_from([None, 2, 3]), blocking=st.booleans())
    def manager_save(self, number, version, keep, blocking):
        """A manager saves the step; unchanged leaves are taken from its latest step."""
        manager, _ = quiet_manager(self.where.location(), max_to_keep=keep, blocking=blocking)
        listed = set(manager.all_steps())
        exists = number in self.model.versions
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with manager:
                    manager.save(number, tree(version))
        except eqxckpt.CheckpointExistsError:
            assert exists, f"step {number} does not exist, but the manager refused to save it"
            return
        assert not exists, f"the manager saved step {number} over an existing one without overwrite=True"
        self.model.saved(number, version)
        if keep is not None:
            for old in sorted(listed | {number})[:-keep]:
                self.model.gone(old)

    @rule(number=STEPS, version=VERSIONS, overwrite=st.booleans(), blocking=st.booleans())
    def plain_save(self, number, version, overwrite, blocking):
        """``eqxckpt.save`` to the step's path."""
        self._plain_save(number, version, overwrite, blocking)

    @rule(number=STEPS, version=VERSIONS, overwrite=st.booleans(), blocking=st.booleans(), at=st.integers(0, 40))
    def save_failing_while_hashing(self, number, version, overwrite, blocking, at):
        """A save whose leaf digests (computed beside its writes) fail at the ``at``-th leaf:
        nothing is committed and the step keeps what it held (a save with fewer leaves
        than that commits, as any other)."""
        import eqxckpt._write._jobs as jobs_module

        real, hashed = jobs_module.digest, []

        def failing(fields, data):
            hashed.append(1)
            if len(hashed) == at + 1:
                raise MemoryError("injected while hashing")
            return real(fields, data)

        jobs_module.digest = failing
        try:
            self._plain_save(number, version, overwrite, blocking)
        except eqxckpt.CheckpointWriteError as e:
            assert "Hashing leaf" in str(e) and "injected while hashing" in str(e), repr(e)
            note(f"save of step {number} failed while hashing, as injected")
        finally:
            jobs_module.digest = real

    def _plain_save(self, number, version, overwrite, blocking):
        exists = number in self.model.versions
        try:
            eqxckpt.save(self.where.step(number), tree(version), overwrite=overwrite, blocking=blocking).wait()
        except eqxckpt.CheckpointError as e:
            if "injected while hashing" in str(e):
                raise  # the model is unchanged: the invariants check the step still holds its version
            # A step whose manifest is damaged may be refused as damaged rather than as existing.
            refused = isinstance(e, eqxckpt.CheckpointExistsError) or not self.model.clean(number)
            # On an object store a step whose manifest is damaged is never replaced, even with
            # overwrite=True: which keys are eqxckpt's cannot be told (the user removes it).
            unprovable = number in self.model.broken and "has a damaged manifest" in str(e)
            assert refused and exists and (not overwrite or unprovable), (
                f"save of step {number} failed (exists: {exists}): {e!r}"
            )
            return
        assert overwrite or not exists, f"save replaced step {number} without overwrite=True"
        self.model.saved(number, version)

    @rule(which=INDEX)
    def delete(self, which):
        """Delete a step the manager lists, as retention does."""
        listed = sorted(self.model.manager_steps())
        if not listed:
            return
        self._delete(listed[which % len(listed)])

    def _delete(self, number: int, wait: float = 0.0) -> None:
        """eqxckpt deletes the step; ``wait``: for so long, tried again while a reader in
        another process holds it (on a local disk a reader's lock defers a deletion)."""
        note(f"delete step {number}")
        where = resolve(self.where.step(number))
        deadline = time.monotonic() + wait
        while not where.delete(unwritten_at(where)):  # what eqxckpt did not write is kept
            assert time.monotonic() < deadline, f"step {number} was not deleted"
            time.sleep(0.01)
        self.model.gone(number)

    # -- faults -------------------------------------------------------------------------------

    @rule(pick=INDEX, at=st.integers(0, 2**20), bit=st.integers(0, 7), truncate=st.booleans(), keep_mtime=st.booleans())
    def rot(self, pick, at, bit, truncate, keep_mtime):
        """Flip one bit of, or truncate, a file or object eqxckpt wrote; on a local disk,
        perhaps setting its modification time back after (an incremental save that shares
        it unread by its stamp must still see the change time move)."""
        keys = self.where.keys()
        kinds = {key: classify(key, self.where.read) for key in keys if key not in self.model.foreign}
        candidates = sorted(key for key, kind in kinds.items() if kind is not None)
        if not candidates:
            return
        key = candidates[pick % len(candidates)]
        kind, body = kinds[key] or "", self.where.read(key)
        if not body:
            return
        identity = self.where.identity(key)
        if self.rotted.get(identity) == body:
            return  # rotted already (a second flip of the same bit would mend it)
        # Who holds it, from the outside, now: later steps that take it must not trust it.
        holders = [n for n in self.model.versions if identity in self.where.held(n, keys)]
        at %= len(body)
        after = body[:at] if truncate else body[:at] + bytes([body[at] ^ (1 << bit)]) + body[at + 1 :]
        self.where.write(key, after, keep_mtime)
        self.rotted[identity] = after
        outcome = effect(kind, body, after)
        how = (f"truncated to {at} bytes" if truncate else f"bit {bit} of byte {at} flipped") + (
            ", mtime set back" if keep_mtime else ""
        )
        note(f"{key} ({kind}, held by steps {sorted(holders)}): {how}: {outcome}")
        for number in holders:
            if outcome == "damaged":
                self.model.damaged.add(number)
            elif outcome == "broken":
                self.model.broken.add(number)
            elif outcome == "suspect":
                self.model.suspect.add(number)

    # -- users' files -------------------------------------------------------------------------

    @rule(
        kind=st.sampled_from(["copy", "export", "notes"]),
        which=INDEX,
        manifest=st.booleans(),
        body=st.binary(min_size=1, max_size=64),
    )
    def put_foreign(self, kind, which, manifest, body):
        """A user's copy of a step (key by key, its arrays first, the manifest perhaps not
        yet), an export named like a save's arrays, or notes, in the run directory."""
        if kind == "copy":
            steps = sorted(self.model.versions)
            if not steps:
                return
            number = steps[which % len(steps)]
            name = f"00{number}"
            keys = [k for k in self.where.keys() if k.startswith(f"{number}/") and "eqxckpt.lease.json" not in k]
            keys.sort(key=lambda k: k.endswith("/eqxckpt.json"))  # the manifest last
            if not manifest:
                keys = [k for k in keys if not k.endswith("/eqxckpt.json")]
            files = {f"{name}/{k.split('/', 1)[1]}": self.where.read(k) for k in keys}
        elif kind == "export":
            files = {f"exports/%arrays.{which:032x}/weights.bin": body}
        else:
            files = {"notes.txt": body}
        for key, content in list(files.items()):
            if key in self.model.foreign or content is None:
                del files[key]
                continue
            self.where.write(key, content)
            self.model.foreign[key] = content
        note(f"user's files: {sorted(files)}")

    @rule(which=INDEX, into_leaf=st.booleans(), body=st.binary(min_size=1, max_size=64))
    def put_inside(self, which, into_leaf, body):
        """A user's file inside a step directory (beside its manifest, or in a leaf's
        directory beside its chunks): retention, deletion and overwrites keep it (#53 item
        7), on a local disk in ``<step>.kept-<hex>``, on an object store where it is."""
        steps = sorted(self.model.versions)
        if not steps:
            return
        number = steps[which % len(steps)]
        leaves = sorted(
            {
                k.rsplit("/", 1)[0]
                for k in self.where.keys()
                if k.startswith(f"{number}/")
                and k.endswith("/zarr.json")
                and k.count("/") > 1 + (self.where.name != "local")
            }
        )
        folder = leaves[which % len(leaves)] if into_leaf and leaves else str(number)
        key = f"{folder}/notes-{len(self.model.inside)}.txt"
        self.where.write(key, body)
        self.model.inside[key] = body
        note(f"user's file inside step {number}: {key}")

    # -- writers in other processes -----------------------------------------------------------

    def _child(self) -> bool:
        return self.started < self.children

    @precondition(_child)
    @rule(number=STEPS, version=VERSIONS, manager=st.booleans(), when=WHEN, sig=st.sampled_from(["KILL", "INT"]))
    def signal_writer(self, number, version, manager, when, sig):
        """SIGKILL, or SIGINT (Ctrl-C), into a child saving a step (a new one, or
        overwriting a whole one) at its k-th progress report or after a delay: what is
        committed loads exactly, nothing half-written is listed."""
        self._signal_writer(number, version, manager, when, sig)

    def _signal_writer(self, number, version, manager, when, sig):
        if number in self.model.versions and not self.model.clean(number):
            return
        self.started += 1
        old = self.model.versions.get(number)
        mode = "overwrite" if old is not None else ("manager" if manager else "plain")
        job = {"run": self.where.location(), "step": self.where.step(number), "number": number, "version": version}
        job["mode"] = mode
        if when[0] == "report":
            job["signal_at"] = [when[1], sig]
        with worker(job) as child:
            if when[0] == "delay":
                assert child.stdout is not None
                child.stdout.readline()  # "ready"
                time.sleep(when[1])
                if child.poll() is None:
                    child.send_signal(getattr(signal, "SIG" + sig))
            out, err = child.communicate(timeout=180)
        if sig == "KILL":
            assert child.returncode in (0, -signal.SIGKILL), err[-3000:]
        else:  # Ctrl-C: the save ends (or finishes first) and KeyboardInterrupt ends the child
            assert child.returncode in (0, 1, -signal.SIGINT), (child.returncode, err[-3000:])
            assert child.returncode != 1 or "KeyboardInterrupt" in err, err[-3000:]
        # No wait for its lease to time out: its holder is dead on this machine, so the next
        # manager finishes its action at once (`_lease.holder_is_gone`).
        manager_, _ = quiet_manager(self.where.location())
        listed = set(manager_.all_steps())
        note(f"SIG{sig} {mode} writer of step {number}: exit {child.returncode}, listed: {number in listed}")
        if old is not None:
            assert number in listed, f"a killed overwrite of step {number} left it uncommitted"
            got = eqxckpt.load(self.where.step(number), tree(0))
            matches = [v for v in (old, version) if same_values(got, tree(v))]
            assert matches, f"a killed overwrite of step {number} left neither the old nor the new values"
            self.model.saved(number, matches[-1])
        elif number in listed:
            self.model.saved(number, version)
        else:
            assert child.returncode != 0, f"the writer finished, but step {number} is not committed"

    @precondition(lambda self: self._child() and self.where.name == "s3")
    @rule(number=STEPS, version=VERSIONS, other=VERSIONS, report=st.integers(1, 4))
    def pause_writer(self, number, version, other, report):
        """SIGSTOP a child overwriting a step at its k-th progress report, past its lease;
        another save replaces the step; the child resumes and must not commit."""
        self.started += 1
        job = {"run": self.where.location(), "step": self.where.step(number), "number": number, "version": version}
        job |= {"mode": "overwrite", "signal_at": [report, "STOP"]}
        with worker(job) as child:
            while child.poll() is None and not is_stopped(child.pid):
                time.sleep(0.01)
            stopped = child.poll() is None
            if stopped:
                time.sleep(LEASE_S * 1.5)
            eqxckpt.save(self.where.step(number), tree(other), overwrite=True)
            child.send_signal(signal.SIGCONT)
            out, err = child.communicate(timeout=180)
        if stopped:
            assert child.returncode == 3, f"a writer stopped past its lease was not refused: {out}{err[-3000:]}"
        else:
            assert child.returncode == 0, err[-3000:]
        self.model.saved(number, other)

    @precondition(_child)
    @rule(after=st.integers(0, 2))
    def preempt(self, after):
        """SIGTERM a training loop whose manager saves on preemption: it saves the step it
        is at and exits 0."""
        self.started += 1
        first = max(self.model.versions, default=0) + 1
        job = {"run": self.where.location(), "step": None, "number": first, "version": 0, "mode": "train"}
        with worker(job) as child:
            assert child.stdout is not None
            while (line := child.stdout.readline()) and line.strip() != f"step {first + after}":
                pass
            child.send_signal(signal.SIGTERM)
            out, err = child.communicate(timeout=180)
        assert child.returncode == 0, err[-3000:]
        found = re.search(r"preemption notice; step (\d+) saved", err)
        assert found, err[-3000:]
        number = int(found.group(1))
        assert number > first + after - 1, (number, first, after)
        self.model.saved(number, train_version(number))

    # -- other tools --------------------------------------------------------------------------

    @rule(kind=st.sampled_from(["step", "prefix", "retired"]), which=INDEX)
    def foreign_delete(self, kind, which):
        """Another tool deletes a whole step (``rm -r``, every key under it), a prefix inside
        one (a leaf's directory on a local disk; a save's own prefix on an object store,
        which later incremental steps may refer to as their base), or a retired prefix (an
        object store's, kept while later steps refer to it). A step that loses its own
        prefix disappears (eqxckpt cannot tell it from a deletion it was interrupted in);
        one that refers to a deleted prefix of another step is skipped by a manager, whose
        warning names it and the prefix; a local step that loses a leaf is damaged. None
        loads other values, nor vanishes unnamed."""
        keys = self.where.keys()
        if kind == "step":
            candidates = [str(n) for n in sorted(self.model.versions)]
        else:
            candidates = self.where.prefixes(keys, retired=kind == "retired")
        if not candidates:
            return
        prefix = candidates[which % len(candidates)]
        refers = {n: self.where.refers(n, keys) for n in self.model.versions}
        gone = set(self.where.remove(prefix))
        note(f"another tool deleted {prefix} ({kind}): {len(gone)} keys")
        for key in list(self.model.inside):
            if key in gone:
                del self.model.inside[key]  # the user's own, deleted with it
        entry = prefix.split("/")[0]
        for number, held in refers.items():
            if not held & gone:
                continue
            if str(number) == entry and (kind == "step" or self.where.name != "local"):
                self.model.gone(number)  # its manifest, or its own arrays, deleted
                with pytest.raises(eqxckpt.CheckpointError):
                    eqxckpt.load(self.where.step(number), tree(0))
            elif str(number) == entry:
                self.model.damaged.add(number)  # a local leaf's directory
            else:
                self.model.broken.add(number)
                if "/%arrays." in prefix:
                    self.model.missing.setdefault(number, set()).add(f"../{prefix}")
                else:  # the whole step: whichever of its prefixes this step refers to
                    names = {"/".join(k.split("/")[:2]) for k in held & gone}
                    self.model.missing.setdefault(number, set()).update(f"../{n}" for n in names)

    @rule(which=INDEX, to=STEPS)
    def foreign_copy(self, which, to):
        """Another tool copies a whole step under a new step number (``cp -r``; key by key,
        the lease aside). eqxckpt must load the copy exactly (a copy is a checkpoint: its
        references are relative), or refuse it: never other values. On an object store the
        copy holds none of the bases it refers to, so retention may delete them under it
        later: from then on it may fail to load, or be skipped (`suspect`)."""
        steps = sorted(self.model.versions)
        keys = self.where.keys()
        if not steps or to in self.model.versions or any(k.split("/")[0] == str(to) for k in keys):
            return
        source = steps[which % len(steps)]
        if source == to:
            return
        self.where.copy(source, to)
        for key, body in list(self.model.inside.items()):  # the user's files in it: copied too
            if key.startswith(f"{source}/") and self.where.read(key) == body:
                self.model.inside[f"{to}/{key.split('/', 1)[1]}"] = body
        version = self.model.versions[source]
        note(f"another tool copied step {source} to {to}")
        try:
            exact = same_values(eqxckpt.load(self.where.step(to), tree(0)), tree(version))
            assert exact, f"the copy of step {source} as {to} loaded other values than {source} holds"
        except eqxckpt.CheckpointError as e:
            assert not self.model.clean(source), f"the copy of undamaged step {source} as {to} does not load: {e!r}"
        model = self.model
        model.saved(to, version)
        for flags in (model.damaged, model.broken, model.suspect):
            if source in flags:
                flags.add(to)
        if source in model.missing:
            model.missing[to] = set(model.missing[source])
        if self.where.name != "local":
            model.suspect.add(to)

    # -- a reader in another process ----------------------------------------------------------

    @precondition(_child)
    @rule(
        ops=st.lists(
            st.tuples(st.sampled_from(["save", "overwrite", "manager", "retain", "delete"]), STEPS, VERSIONS),
            min_size=1,
            max_size=4,
        ),
        lazy=st.booleans(),
    )
    def concurrent_reader(self, ops, lazy):
        """A reader in another process loads every step number in turn (whole, or lazily a
        few slices, through `eqxckpt.open`) while saves, overwrites, incremental saves,
        retention and deletions run here. Each read must be exactly the values of one
        version the model says that step held at some moment while it ran, or raise a
        `CheckpointError`. (On a local disk a read defers a deletion, retention's too: the
        harness tries it again, as the manager's next save would.)"""
        self.started += 1
        held = {n: {v} for n, v in self.model.versions.items()}
        stop = pathlib.Path(tempfile.mkdtemp()) / "stop"
        job = {"mode": "read", "steps": {n: self.where.step(n) for n in range(6)}, "lazy": lazy, "stop": str(stop)}
        with worker(job) as child:
            assert child.stdout is not None and child.stdout.readline() == "ready\n"
            for kind, number, version in ops:
                if kind in ("save", "overwrite"):
                    self._plain_save(number, version, kind == "overwrite", True)
                elif kind in ("manager", "retain"):
                    self.manager_save(number, version, 2 if kind == "retain" else None, True)
                elif number in self.model.manager_steps():
                    self._delete(number, wait=30)
                self._settle()
                for n, v in self.model.versions.items():
                    held.setdefault(n, set()).add(v)
            time.sleep(0.2)  # a few reads of the last state too
            stop.touch()
            out, err = child.communicate(timeout=120)
        shutil.rmtree(stop.parent, ignore_errors=True)
        assert child.returncode == 0, err[-3000:]
        outcomes = [json.loads(line) for line in out.splitlines()]
        note(f"reader ({'lazy' if lazy else 'load'}): {outcomes}")
        for got in outcomes:
            number = got["n"]
            if "error" in got:
                assert got["ours"], f"a read of step {number} raised {got['error']}: {got['message']}"
                continue
            assert got["versions"], f"a read of step {number} returned values of no version: {got}"
            assert set(got["versions"]) & held.get(number, set()), (
                f"a read of step {number} returned version {got['versions']}; it held {held.get(number)}"
            )

    def _settle(self) -> None:
        """Steps the model says were deleted that a fresh manager still lists: a reader's
        lock deferred retention's deletion (local disks): delete them now, waiting for it."""
        if self.where.name != "local":
            return
        manager, _ = quiet_manager(self.where.location())
        for number in set(manager.all_steps()) - set(self.model.versions):
            self._delete(number, wait=30)

    # -- forks and signals --------------------------------------------------------------------

    @precondition(_child)
    @rule(version=VERSIONS, child=st.sampled_from(["exit", "sigterm"]), delay=st.floats(0.0, 0.3))
    def fork_during_background_save(self, version, child, delay):
        """A process forks while its manager saves in the background (a data loader's
        worker): the child ends promptly, leaving the manager's block (``sys.exit``) or
        by SIGTERM, and the parent's save commits."""
        self.started += 1
        number = max(self.model.versions, default=-1) + 1
        job = {"run": self.where.location(), "step": None, "number": number, "version": version, "mode": "fork"}
        job |= {"child": child, "delay": delay}
        with worker(job) as writer:
            out, err = writer.communicate(timeout=180)
        assert writer.returncode == 0 and "committed" in out, err[-3000:]
        found = re.search(r"child (\S+) (\S+)", out)
        assert found and found.group(1) != "hung", f"the forked child did not end: {out}"
        status, seconds = int(found.group(1)), float(found.group(2))
        assert status == (0 if child == "exit" else -signal.SIGTERM), out
        assert seconds < 10, f"the forked child took {seconds} s to end"
        self.model.saved(number, version)

    @precondition(lambda self: self._child() and self.where.name == "s3")
    @rule(version=VERSIONS, other=VERSIONS, during=st.booleans(), delay=st.floats(0.0, 0.3))
    def stalled_preemption(self, version, other, during, delay):
        """SIGTERM to a process whose manager (``preemption_grace_s``) saves in the background
        to a store that stopped answering (a proxy on 127.0.0.1, paused before that save,
        or ``delay`` s into it): the process ends by SIGTERM within twice the grace period
        (and a bounded time more); its committed step loads exactly, the step it was saving
        is committed whole or not listed."""
        self.started += 1
        number = max(self.model.versions, default=-1) + 1
        proxy = DroppingProxy(self.where.store.endpoint)
        go = pathlib.Path(tempfile.mkdtemp()) / "go"
        job = {"run": s3_spec(proxy.endpoint, self.where.top), "number": number, "version": version, "mode": "stall"}
        job |= {"next": other, "grace": GRACE_S, "go": str(go), "step": None}
        try:
            with worker(job) as child:
                assert child.stdout is not None
                assert child.stdout.readline() == "saved\n", child.communicate(timeout=60)
                if not during:
                    proxy.pause()
                go.touch()
                assert child.stdout.readline() == "saving\n"
                if during:
                    time.sleep(delay)
                    proxy.pause()
                child.send_signal(signal.SIGTERM)
                start = time.monotonic()
                out, err = child.communicate(timeout=120)
                took = time.monotonic() - start
        finally:
            proxy.drop()  # what it holds is never delivered: nothing lands after the check
            shutil.rmtree(go.parent, ignore_errors=True)
        assert child.returncode == -signal.SIGTERM, (child.returncode, err[-3000:])
        assert took < 2 * GRACE_S + GRACE_SLACK_S, f"SIGTERM took {took:.1f} s to end the process"
        self.model.saved(number, version)
        manager, _ = quiet_manager(self.where.location())
        note(
            f"stalled store, SIGTERM: ended in {took:.1f} s; step {number + 1} listed: {number + 1 in manager.all_steps()}"
        )
        if number + 1 in manager.all_steps():
            self.model.saved(number + 1, other)

    # -- what must hold after every rule ------------------------------------------------------

    @invariant()
    def users_files_untouched(self):
        for key, body in self.model.foreign.items():
            found = self.where.read(key)
            assert found == body, f"{key!r}, which eqxckpt did not write, was {'changed' if found else 'deleted'}"
        for key, body in self.model.inside.items():
            number, rest = key.split("/", 1)
            places = [key]
            if isinstance(self.where, LocalRun):  # kept beside the step, if eqxckpt deleted or replaced it
                places += [str(p.relative_to(self.where.run)) for p in self.where.run.glob(f"{number}.*-*/{rest}")]
            assert any(self.where.read(place) == body for place in places), (
                f"{key!r}, which a user put inside step {number}, was deleted or changed (looked in {places})"
            )

    @invariant()
    def steps_are_what_the_model_says(self):
        manager, caught = quiet_manager(self.where.location())
        listed = set(manager.all_steps())
        model = self.model
        expected = set(model.versions) - model.broken - model.suspect
        assert expected <= listed and listed <= expected | model.suspect, (
            f"the manager lists {sorted(listed)}; committed: {sorted(expected)}, damaged manifests: "
            f"{sorted(model.broken)}, maybe: {sorted(model.suspect)}"
        )
        model.listed = listed & model.suspect
        for number in model.broken:
            assert any(f"{number} (" in message for message in caught), (
                f"step {number}'s manifest is damaged, but the manager did not warn: {caught}"
            )
        for number, prefixes in model.missing.items():
            assert any(f"{number} (" in m and any(p in m for p in prefixes) for m in caught), (
                f"step {number} refers to {sorted(prefixes)}, which another tool deleted, but no warning names both: "
                f"{caught}"
            )
        keys = self.where.keys()
        for number, version in sorted(model.versions.items()):
            want = tree(version)
            try:
                exact = same_values(eqxckpt.load(self.where.step(number), tree(0)), want)
                assert exact, f"step {number} loaded other values than it was saved with (version {version})"
            except eqxckpt.CheckpointError as e:
                exact = False
                assert not model.clean(number), f"step {number} is undamaged but does not load: {e!r}"
            try:
                ok = eqxckpt.verify(self.where.step(number)).ok
            except eqxckpt.CheckpointError as e:
                assert not model.clean(number), f"verify of undamaged step {number} raised {e!r}"
                ok = False
            if number in model.damaged | model.broken:
                assert not ok, f"verify passed step {number}, which is damaged"
            elif number in model.suspect:
                assert exact or not ok, f"verify passed step {number}, which does not load exactly"
            elif not any(
                self.where.read(k)
                for k in model.inside
                if k in self.where.refers(number, keys) or k.startswith(f"{number}/")
            ):
                assert ok, f"verify flagged step {number}, which is undamaged"  # (a user's file in it: may)
        self.users_files_untouched()


def run_machine(request, make_run, examples: int, steps: int) -> None:
    """Run the machine: ``examples`` runs of ``steps`` rules, one child process each (the
    short profile); with ``--slow``, 200 runs of 25 rules, three child processes each."""
    slow = request.config.getoption("--slow")
    machine = type("FaultModel", (FaultModel,), {"make_run": classmethod(lambda cls: make_run())})
    machine.children = 3 if slow else 1
    profile = settings(
        max_examples=200 if slow else examples,
        stateful_step_count=25 if slow else steps,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
    run_state_machine_as_test(machine, settings=profile)


def test_fault_model_on_a_local_disk(tmp_path, request):
    def make_run():
        root = tmp_path / uuid.uuid4().hex[:8]
        root.mkdir()
        return LocalRun(root)

    run_machine(request, make_run, examples=4, steps=8)


def test_fault_model_on_object_stores(store, request):
    run_machine(request, lambda: StoreRun(store, f"fault-model/{uuid.uuid4().hex[:8]}/"), examples=3, steps=6)


# -- the local tier ---------------------------------------------------------------------------


class LocalTierModel(RuleBasedStateMachine):
    """A run with a local tier (one process, a local disk for both tiers), against a model
    of what each run saved: steps saved locally, persistently or both, a SIGKILLed writer
    mid-save, the host's tier wiped, a stale copy of it brought back, the persistent run
    deleted and begun again. After every rule a fresh manager resumes from a step of the
    current run no older than its newest persistent step, with exactly that step's values
    (or from nothing, if the run has none): never a deleted run's, never a mix."""

    def __init__(self):
        super().__init__()
        self.root = pathlib.Path(self.workdir()) / uuid.uuid4().hex[:8]
        self.run, self.local = self.root / "run", self.root / "local"
        self.generation = 0  # the run now at `run`: begun again after each deletion
        # This run's steps (either tier): each save's version, and whether it surely completed.
        self.saved: dict[int, list[tuple[int, bool]]] = {}
        self.stale_back = False  # a stale copy of the tier was brought back: older saves may win
        self.persistent: set[int] = set()
        self.next = 1  # step 0 is a multiple of every interval: the persistent tier saves it too
        self.stale: list[pathlib.Path] = []
        self.rewinds = 0

    @classmethod
    def workdir(cls) -> str:
        raise NotImplementedError

    def _version(self, step: int) -> int:
        # Each run and each rewind saves other values: a step saved again differs.
        return self.generation * 100 + self.rewinds * 10_000 + step

    def _options(self) -> dict:
        return dict(save_interval_steps=10**9, local_path=self.local, local_interval_steps=1)

    @rule(persist=st.booleans(), steps=st.integers(1, 3))
    def save(self, persist, steps):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # parts of a deleted run, deleted with a warning
            with eqxckpt.CheckpointManager(self.run, **self._options()) as manager:
                for _ in range(steps):
                    step, self.next = self.next, self.next + 1
                    manager.save(step, tree(self._version(step)), force=persist)
                    manager.wait()
                    self.saved.setdefault(step, []).append((self._version(step), True))
                    if persist:
                        self.persistent.add(step)

    @rule(at=st.floats(0.0, 1.5))
    def kill_local_save(self, at):
        """A writer saving the next step (locally) is SIGKILLed at a random instant: that
        step may or may not be complete, never half of it."""
        step, self.next = self.next, self.next + 1
        options = f"save_interval_steps=10**9, local_path={str(self.local)!r}, local_interval_steps=1"
        script = (
            f"import sys, warnings, eqxckpt; sys.path.insert(0, {str(WORKERS)!r})\n"
            "from fault_model_worker import tree\n"
            "warnings.simplefilter('ignore')\n"
            f"with eqxckpt.CheckpointManager({str(self.run)!r}, {options}) as m:\n"
            "    print('ready', flush=True)\n"
            f"    m.save({step}, tree({self._version(step)})); m.wait()\n"
        )
        child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        time.sleep(at)
        child.kill()
        child.wait()
        self.saved.setdefault(step, []).append((self._version(step), False))  # complete or not

    @precondition(lambda self: self.persistent)
    @rule()
    def rewind_to_the_newest_persistent_step(self):
        """A user resumes from the newest persistent step (not the newer local ones) and
        trains on: the next steps are saved again, with other values (the second outside
        attack: an older save of a step came back with a stale tier)."""
        newest = max(self.persistent)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with eqxckpt.CheckpointManager(self.run, **self._options()) as manager:
                assert same_values(manager.load(tree(0), step=newest), tree(self.saved[newest][-1][0]))
        self.rewinds += 1
        self.next = newest + 1

    @rule()
    def wipe_tier(self):
        shutil.rmtree(self.local, ignore_errors=True)

    @rule()
    def keep_a_copy_of_the_tier(self):
        if self.local.exists():
            copy = self.root / f"stale-{len(self.stale)}"
            shutil.copytree(self.local, copy, symlinks=True)
            self.stale.append(copy)

    @precondition(lambda self: self.stale)
    @rule(which=INDEX)
    def bring_back_a_stale_tier(self, which):
        shutil.rmtree(self.local, ignore_errors=True)
        shutil.copytree(self.stale[which % len(self.stale)], self.local, symlinks=True)
        self.stale_back = True

    @rule()
    def delete_and_restart_the_run(self):
        shutil.rmtree(self.run, ignore_errors=True)
        self.generation += 1
        self.saved, self.persistent, self.next, self.stale_back = {}, set(), 1, False

    @invariant()
    def resumes_from_a_step_of_this_run_exactly(self):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with eqxckpt.CheckpointManager(self.run, **self._options()) as manager:
                assert sorted(manager.all_steps()) == sorted(self.persistent)
                start = manager.latest_step()
                if start is None:
                    assert not self.persistent
                    return
                assert start in self.saved and start >= max(self.persistent, default=-1), (start, self.saved)
                got = manager.load(tree(0))
        # One save of the step, whole; the newest, where it surely completed and no older
        # copy of the tier came back since.
        versions = [version for version, _ in self.saved[start]]
        newest, certain = self.saved[start][-1]
        if certain and not self.stale_back:
            versions = [newest]
        assert any(same_values(got, tree(v)) for v in versions), f"step {start} ({self.generation}): not {versions}"

    def teardown(self):
        shutil.rmtree(self.root, ignore_errors=True)


def test_fault_model_of_the_local_tier(tmp_path, request):
    slow = request.config.getoption("--slow")
    machine = type("LocalTierModel", (LocalTierModel,), {"workdir": classmethod(lambda cls: str(tmp_path))})
    profile = settings(
        max_examples=100 if slow else 4,
        stateful_step_count=20 if slow else 6,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
    run_state_machine_as_test(machine, settings=profile)


# -- defects the machine found, each reduced to a test of its own --------------------------


def test_a_forked_child_leaving_the_managers_block_does_not_wait_for_the_parents_save(tmp_path):
    """Found by `fork_during_background_save`. docs/concurrency.md: a process forked after a
    manager's first save "does not inherit the parent's background saves (their thread is
    the parent's), so it exits without waiting for them". A child that forks while the
    manager's background save runs and leaves the manager's ``with`` block (``sys.exit``)
    hung in ``CheckpointManager.close`` on the parent's save's future, which no thread in
    the child will ever finish. The child ends at once (exit 0)."""
    job = {"run": str(tmp_path / "run"), "step": None, "number": 0, "version": 1, "mode": "fork"}
    job |= {"child": "exit", "delay": 0.0, "patience": 5}
    with worker(job) as writer:
        out, err = writer.communicate(timeout=180)
    assert writer.returncode == 0 and "committed" in out, err[-3000:]
    assert re.search(r"child 0 \d", out), f"the forked child did not end at once: {out}"


# -- a job of several processes -----------------------------------------------------------------


@pytest.mark.multiprocess
def test_fault_model_across_processes(tmp_path, request):
    """Jobs of 2 or 3 JAX processes on 127.0.0.1 resume one run on a local disk: each loads
    every listed step (its replicated leaf restored read once), then saves more
    (replica-parallel, with retention and incremental reuse). In all but the last job a
    process is SIGKILLed at a random instant (loading or saving) and the others are killed
    with it, as a scheduler would; the next job has another process count. After each job
    every listed step loads exactly here (one process) and in the next job, and no step
    its save did not finish whole is listed. The instants come from a fixed seed."""
    import random

    from conftest import end_workers, start_workers
    from fault_model_processes import SHAPE, SPECS, tag  # pyright: ignore[reportMissingImports]
    from test_replicas_faults import _parsed

    slow = request.config.getoption("--slow")
    rng = random.Random(20261129)
    run = tmp_path / "run"
    jobs = 8 if slow else 3
    counts = [2, 3] if slow else [2, 3, 2]
    attempted: set[int] = set()
    for job in range(jobs):
        processes = counts[job % len(counts)]
        last = job == jobs - 1
        victim = None if last else rng.randrange(processes)
        delay = rng.uniform(0.0, 1.2)
        directory = tmp_path / f"job{job}"
        directory.mkdir()
        workers, logs = start_workers(
            WORKERS / "fault_model_processes.py", "round", processes, directory,
            FM_RUN=str(run), FM_SAVES="3", EQXCKPT_BARRIER_TIMEOUT_S="30",
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 180
            if victim is not None:
                while '"listed"' not in logs[victim].read_text():
                    assert workers[victim].poll() is None and time.monotonic() < deadline, logs[victim].read_text()
                    time.sleep(0.02)
                time.sleep(delay)
                workers[victim].kill()
                for other in workers:  # the job is lost: the scheduler ends it
                    other.kill()
            while any(w.poll() is None for w in workers):
                assert time.monotonic() < deadline, "\n".join(log.read_text() for log in logs)
                time.sleep(0.05)
        finally:
            end_workers(workers)
        texts = [log.read_text() for log in logs]
        results = [[_parsed(line[7:]) for line in t.splitlines() if line.startswith("RESULT ")] for t in texts]
        if victim is None:
            assert all(w.returncode == 0 for w in workers), texts
        for rs in results:
            for r in rs:
                assert r.get("bad", 0) == 0, f"job {job} ({processes} processes) loaded step {r['checked']} wrong"
                if "saving" in r:
                    attempted.add(r["saving"])
        saved = {r["saved"] for rs in results for r in rs if "saved" in r}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            listed = eqxckpt.CheckpointManager(run).all_steps()
        summary = f"job {job}: {processes} processes, victim {victim} after {delay:.2f} s; saved {sorted(saved)}, listed {listed}"
        print(summary)
        assert set(listed) <= attempted, summary
        # A job killed after a step committed and before retention deleted the oldest keeps one
        # step more (never one fewer); the next job's first save deletes it.
        kept = 3 if victim is None else 4
        assert len(listed) <= kept and (not listed or set(listed) >= {s for s in saved if s > max(listed) - 3}), summary
        for step in listed:
            got = eqxckpt.load(run / str(step))
            for name in SPECS:
                want = values_of(tag(step, name), SHAPE)
                assert np.asarray(got[name]).tobytes() == want.tobytes(), f"{summary}: step {step} {name} differs"
    assert listed, "the last job saved nothing"


def values_of(path: str, shape) -> np.ndarray:
    from attack_worker import values  # pyright: ignore[reportMissingImports]

    return values(path, shape, np.float32)
