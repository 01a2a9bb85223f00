"""The lease on an object-store checkpoint's place: the ``eqxckpt.lease.json`` document
(what its holder is doing, and until when it counts as alive), `Lease` (this process's,
taken, changed, renewed and released by conditional writes) and `read_lease`. The
protocol it fences: docs/concurrency.md ("Object stores").
"""

import functools
import json
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import tensorstore as ts

from .._errors import CheckpointBusyError, ManifestError, warn_at_caller
from .._manifest import MAX_MANIFEST_BYTES
from .._paths import LEASE_NAME, is_arrays_name, validate_path
from ._kvstore import read_bounded

LEASE_FORMAT = "eqxckpt-lease"
# What a lease's holder is doing: writing a save's arrays, committing that save, or
# deleting a checkpoint. A lease with no action was written by eqxckpt before
# saves had prefixes of their own: its "paths" are what its save wrote.
ACTIONS = ("save", "commit", "delete")
LOST = (
    "This save lost its lease: another process took over the place, because the save's heartbeat looked older "
    "than the lease timeout (this process was paused, or a clock ran ahead) or this process looked dead from the "
    "same machine (machines restored from one snapshot). Nothing was committed; save again."
)


def lease_timeout() -> float:
    return float(os.environ.get("EQXCKPT_LEASE_TIMEOUT_S", "600"))


def parse_lease(raw: bytes) -> dict | None:
    """A lease document, or None if ``raw`` is not one eqxckpt wrote."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != LEASE_FORMAT:
        return None
    paths, heartbeat, timeout = doc.get("paths"), doc.get("heartbeat_unix"), doc.get("timeout_s")
    arrays, base = doc.setdefault("arrays", []), doc.setdefault("base", "")
    if not (isinstance(paths, list) and all(isinstance(p, str) for p in paths)):
        return None
    if not (isinstance(arrays, list) and all(is_arrays_name(a) for a in arrays) and _is_hex(base)):
        return None
    # A commit: the prefix of the checkpoint it replaces, retired once it has committed.
    retire = doc.setdefault("retire", [])
    if not (isinstance(retire, list) and len(retire) <= 1 and all(is_arrays_name(a) for a in retire)):
        return None
    action = doc.setdefault("action", None)
    # A save or its commit names exactly its own prefix; a deletion, the one it deletes (none
    # for a checkpoint from before prefixes); a lease from before prefixes, none.
    if action not in (*ACTIONS, None) or len(arrays) > 1 or (action in ("save", "commit") and len(arrays) != 1):
        return None
    # A NaN or infinite heartbeat (Python's JSON reads both) would never go stale.
    if not (_finite(heartbeat) and isinstance(timeout, (int, float)) and _finite(timeout) and timeout > 0):
        return None
    try:
        for path in paths:
            validate_path(path, what="lease path")
    except ManifestError:
        return None
    return doc


def _is_hex(text: Any) -> bool:
    try:
        bytes.fromhex(text)
    except (TypeError, ValueError):
        return False
    return True


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def is_stale(doc: dict, now: float | None = None) -> bool:
    return (time.time() if now is None else now) > doc["heartbeat_unix"] + doc["timeout_s"]


def is_abandoned(doc: dict) -> bool:
    """Whether a lease's holder stopped: its heartbeat is stale, or it is provably dead
    (`holder_is_gone`), as after a SIGKILL on this machine: then nobody waits out the
    timeout. Either way taking it over is safe (docs/concurrency.md, "Object stores")."""
    return is_stale(doc) or holder_is_gone(doc)


@functools.cache
def _machine() -> tuple[str, str] | None:
    """This kernel boot's id and this process's pid namespace: where a pid names one
    process, and its start time tells it from a later one with the same pid. None where
    either cannot be read (no /proc), or where /proc numbers processes as another pid
    namespace does (a process that entered a container's namespace and kept the host's
    /proc): there a pid read from a lease cannot be looked up."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        if os.readlink("/proc/self") != str(os.getpid()):
            return None
        return boot, os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _started(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, ``/proc/PID/stat``); None if
    there is no such process, or it is a zombie (killed, not yet waited for). Raises
    `OSError` or `ValueError` where that cannot be told."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        fields = stat[stat.rindex(")") + 2 :].split()  # after the command name, which may hold anything
        # A zombie leader with other threads is a live process whose main thread ended.
        if fields[0] in ("Z", "X") and len(os.listdir(f"/proc/{pid}/task")) <= 1:
            return None
    except FileNotFoundError:
        return None
    return int(fields[19])


def _holder() -> dict[str, Any]:
    """What a lease records of its holder for `holder_is_gone` (nothing where unknown)."""
    machine = _machine()
    try:
        started = _started(os.getpid())
    except (OSError, ValueError, IndexError):
        started = None
    if machine is None or started is None:
        return {}
    return {"boot_id": machine[0], "pid_namespace": machine[1], "pid_started": started}


def holder_is_gone(doc: dict) -> bool:
    """Whether the lease ``doc``'s holder is provably dead: it ran in this kernel boot and
    pid namespace, and no process with its pid and start time is alive. False wherever
    that cannot be told (another machine, a container of its own, a lease without it)."""
    machine, pid, started = _machine(), doc.get("pid"), doc.get("pid_started")
    if machine is None or [doc.get("boot_id"), doc.get("pid_namespace")] != list(machine):
        return False
    if type(pid) is not int or pid <= 0 or type(started) is not int:
        return False
    try:
        return _started(pid) != started
    except (OSError, ValueError, IndexError):
        return False


def describe_lease(doc: dict) -> str:
    age = time.time() - doc["heartbeat_unix"]
    return (
        f"{doc.get('purpose', 'save')} by {doc.get('host', '?')} pid {doc.get('pid', '?')}, "
        f"last heartbeat {age:.0f} s ago, abandoned after {doc['timeout_s']:.0f} s"
    )


_warned_endpoints: set[str] = set()


def warn_if_not_atomic(kvstore: dict) -> None:
    """Leases rely on the store's conditional writes. TensorStore sends real ones
    (``If-None-Match``/``If-Match``) to AWS S3; for other S3 endpoints it
    emulates them with a check then a write, which two writers can both pass,
    unless ``TENSORSTORE_S3_USE_CONDITIONAL_WRITE=1`` is set."""
    if kvstore.get("driver") != "s3":
        return
    endpoint = str(kvstore.get("endpoint", ""))
    host = endpoint.split("://")[-1].split("/")[0]
    atomic = (
        not endpoint
        or host.endswith("amazonaws.com")
        or os.environ.get("TENSORSTORE_S3_USE_CONDITIONAL_WRITE", "").lower() in ("1", "true", "yes")
    )
    if not atomic and endpoint not in _warned_endpoints:
        _warned_endpoints.add(endpoint)
        warn_at_caller(
            f"Saving to the S3-compatible endpoint {endpoint} without atomic conditional writes: two processes "
            "saving to one place at the same moment could both proceed. If the server supports If-Match and "
            "If-None-Match (MinIO, Ceph, moto do), set TENSORSTORE_S3_USE_CONDITIONAL_WRITE=1.",
        )


class Lease:
    """This process's lease on an object-store checkpoint: taken, changed, renewed and
    released, each by a write on condition that the lease is still the one it wrote."""

    def __init__(
        self,
        store: ts.KvStore,
        purpose: str,
        seen: bytes,
        *,
        action: str | None,
        arrays: Sequence[str] = (),
        paths: Sequence[str] = (),
        base: bytes = b"",
        retire: Sequence[str] = (),
    ):
        """Take the lease, on condition that the lease object is still what was
        read (``seen``: the generation of a read that found none, or of the
        abandoned lease being taken over)."""
        self.store = store
        self.save_id = uuid.uuid4().hex
        self.timeout = lease_timeout()
        self.doc = {
            "format": LEASE_FORMAT,
            "purpose": purpose,
            "action": action,
            "save_id": self.save_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            **_holder(),
            "started_unix": time.time(),
            "heartbeat_unix": time.time(),
            "timeout_s": self.timeout,
            "arrays": list(arrays),
            "paths": sorted(set(paths)),
            "base": base.hex(),
            "retire": list(retire),
        }
        generation = self._write(seen)
        if generation is None:
            raise CheckpointBusyError(
                "Another process took the lease on this checkpoint first; it is saving or "
                "deleting there now. Nothing was changed."
            )
        self.generation: bytes = generation
        self.lost = False
        self._lock = threading.Lock()  # one conditional write at a time: the heartbeat's or the owner's
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _write(self, if_equal: bytes) -> bytes | None:
        self.doc["heartbeat_unix"] = time.time()
        stamp = self.store.write(LEASE_NAME, json.dumps(self.doc).encode(), if_equal=if_equal).result()
        return stamp.generation or None  # empty: the condition failed

    def update(self, **fields: Any) -> None:
        """Change the lease's document, on condition that it is still this process's
        (raises `CheckpointBusyError` if another process took it over)."""
        with self._lock:
            if not self.lost:
                self.doc.update(fields)
                generation = self._write(self.generation)
                if generation is not None:
                    self.generation = generation
                    return
            self.lost = True
        raise CheckpointBusyError(LOST)

    def start_heartbeat(self) -> None:
        def beat() -> None:
            while not self._stop.wait(self.timeout / 4):
                try:
                    self.update()
                except CheckpointBusyError:
                    return
                except Exception:  # noqa: BLE001 - a transient error: try again at the next beat
                    continue

        self._thread = threading.Thread(target=beat, name="eqxckpt-lease", daemon=True)
        self._thread.start()

    def stop_heartbeat(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def check(self) -> None:
        """Raise unless this process still holds the lease."""
        _, doc = read_lease(self.store)
        if self.lost or doc is None or doc.get("save_id") != self.save_id:
            self.lost = True
            raise CheckpointBusyError(LOST)

    def release(self) -> None:
        """Stop renewing and delete the lease, if it is still ours."""
        self.stop_heartbeat()
        if not self.lost:
            self.store.write(LEASE_NAME, None, if_equal=self.generation).result()


def read_lease(store: ts.KvStore) -> tuple[Any, dict | None]:
    """The lease at a checkpoint's root: (read result, its document or None)."""
    # Bounded: a lease lists at most a manifest's leaf paths; a huge object there is not one.
    current = read_bounded(store, LEASE_NAME, MAX_MANIFEST_BYTES)
    return current, (parse_lease(bytes(current.value)) if current.state == "value" else None)
