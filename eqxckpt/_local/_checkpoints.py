"""`LocalCheckpoints`: a `CheckpointManager`'s local tier. Frequent saves of each
process's part to a disk or tmpfs of its own host, copied to peers, and resume from the
newest step every process can rebuild.

A local save of a step, in every process:

1. its part (`HostShards`) is taken on the caller's thread, then, in the background,
2. kept in its own tier (`LocalTier.write`: atomic, checksummed),
3. offered to the peers that keep copies of it (`placement`), which fetch it with JAX's
   transfer service and keep it in theirs (phases ``offer`` and ``copy``, every process),
4. and once every process has come through ``copy``, the step is complete: retention
   keeps the newest ``max_to_keep`` complete steps and deletes every other piece.

Every piece of one save carries the save's token (a session agreed at the first local
save, and the step), so a piece of another save of the same step (a job that died
before finishing it, an older run's) is never taken for it.
"""

import concurrent.futures
import dataclasses
import json
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import jax
from jaxtyping import PyTree

from .._distributed import Phases, coordination_client
from .._errors import ArgumentError, CheckpointError, CheckpointExistsError
from .._storage import Storage
from ._layout import LocalTier, PieceInfo
from ._peers import Transfers, failure_domain, placement, transfer_id
from ._shards import HostShards


@dataclasses.dataclass(frozen=True)
class LocalChoice:
    """A step every process can rebuild from the local tier: the save (``token``) of
    ``step`` and, for each process, which process keeps the piece it restores from."""

    step: int
    token: str
    sources: dict[int, int]
    complete: list[tuple[int, str]]  # every save (step, token) every process can rebuild, up to this one


def _positive(name: str, value: Any, zero: bool = False) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < (0 if zero else 1):
        raise ArgumentError(f"{name} must be a {'non-negative' if zero else 'positive'} int, got {value!r}.")
    return value


class LocalCheckpoints:
    """The local tier of the run saved persistently at ``persistent``.

    **Arguments:**

    - `local_path`: this host's directory for it (a tmpfs or local disk).
    - `persistent`: the run's persistent directory (names the tier).
    - `interval`: save every this many steps.
    - `replicas`: peers keeping a copy of each process's pieces.
    - `max_to_keep`: complete steps kept.

    ```python
    local = LocalCheckpoints("/dev/shm/run", resolve("gs://b/run"), interval=50, replicas=1, max_to_keep=1)
    local.save(50, state)
    ```
    """

    def __init__(self, local_path: Any, persistent: Storage, interval: int, replicas: int, max_to_keep: int):
        self.interval = _positive("local_interval_steps", interval)
        self.replicas = _positive("local_replicas", replicas, zero=True)
        self.max_to_keep = _positive("local_max_to_keep", max_to_keep)
        self.me, self.processes = jax.process_index(), jax.process_count()
        self.tier = LocalTier(local_path, persistent, self.me)
        self.transfers = Transfers()
        self._session: str | None = None
        self._holders: list[list[int]] = [[] for _ in range(self.processes)]
        self._addresses: list[str] = []
        self._complete: list[tuple[int, str]] = []  # (step, token) of the complete saves kept
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="eqxckpt-local")
        self._pending: concurrent.futures.Future | None = None
        # Reads and writes of a process's own part, beside the transfers of the others.
        self._writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="eqxckpt-local-own")
        # Parts `choose` read (and so checked) for the restore that follows; dropped at a save.
        self._parts: dict[tuple[int, int, str], HostShards] = {}

    # -- saving ------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        return step % self.interval == 0

    def save(self, step: int, tree: PyTree, blocking: bool = False) -> None:
        """Save ``tree`` as ``step`` in the local tier (every process, as for `eqxckpt.save`):
        its part is taken now, the rest happens in the background unless ``blocking``.
        Waits for the previous local save first and raises its error."""
        self.wait()
        self._parts.clear()
        if self._complete and step <= self._complete[-1][0]:
            raise CheckpointExistsError(
                f"Step {step} is not newer than the local tier's newest step, {self._complete[-1][0]}: each step "
                "is saved once, in order. Resume from latest_step() + 1."
            )
        part = HostShards.take(tree)
        if blocking:
            self._write(step, part)
        else:
            self._pending = self._executor.submit(self._write, step, part)

    def wait(self) -> None:
        """Wait for the local save in flight; raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.result()
            except CheckpointError as e:
                raise type(e)(f"The local tier's save failed: {e}") from e

    def _join(self) -> None:
        """Agree on the session and where copies go (once, at the first local save)."""
        if self._session is not None:
            return
        if self.processes == 1:
            self._session = uuid.uuid4().hex
            return
        mine = {"domain": failure_domain(), "address": self.transfers.address if self.replicas else ""}
        if self.me == 0:
            mine["session"] = uuid.uuid4().hex
        found = [json.loads(r) for r in Phases("local").run("join", lambda: json.dumps(mine))]
        self._holders = placement([f["domain"] for f in found], self.replicas)
        self._addresses = [f["address"] for f in found]
        self._session = found[0]["session"]

    def _write(self, step: int, part: HostShards) -> None:
        self._join()
        token = f"{self._session}:{step}"
        if self.processes == 1:
            self.tier.write(self.me, step, token, self.processes, part)
        else:
            self._copy(step, token, part)
        self._completed(step, token)

    def _copy(self, step: int, token: str, part: HostShards) -> None:
        """Phases ``offer`` (each process offers its part to its peers) and ``copy`` (each
        keeps its own part and the peers' it fetches): a failure anywhere is raised in
        every process at the same phase."""
        client = coordination_client()
        phases = Phases("local")
        owners = [owner for owner, holders in enumerate(self._holders) if self.me in holders]

        def offer() -> str:
            if self._holders[self.me]:
                arrays = self.transfers.offer(transfer_id(token, self.me), part)
                client.key_value_set(f"{phases.name}/{self.me}", json.dumps({"leaves": part.leaves, "arrays": arrays}))
            return ""

        def copy() -> str:
            # Its own part is written while the peers' parts are fetched and written.
            own = self._writer.submit(self.tier.write, self.me, step, token, self.processes, part)
            try:
                for owner in owners:
                    described = json.loads(client.blocking_key_value_get(f"{phases.name}/{owner}", 60_000))
                    number = transfer_id(token, owner)
                    fetched = self.transfers.fetch(
                        self._addresses[owner], number, described["leaves"], described["arrays"]
                    )
                    self.tier.write(owner, step, token, self.processes, fetched)
            finally:
                own.result()
            return ""

        try:
            phases.run("offer", offer)
            phases.run("copy", copy)
        finally:
            self.transfers.release(transfer_id(token, self.me))
        if self._holders[self.me]:
            client.key_value_delete(f"{phases.name}/{self.me}")

    def _completed(self, step: int, token: str) -> None:
        """The save ``token`` of ``step`` is complete in every process: keep the newest
        complete saves, delete every other piece (older ones, and those of saves that
        never completed: an interrupted one's, an older run's)."""
        self._complete = sorted({save for save in self._complete if save[0] != step} | {(step, token)})
        self._complete = self._complete[-self.max_to_keep :]
        kept = set(self._complete)
        self.tier.delete([info for info in self.tier.pieces() if (info.step, info.token) not in kept])

    # -- resuming ----------------------------------------------------------------------

    def choose(self, persistent_latest: int | None, step: int | None = None) -> tuple[LocalChoice | None, int | None]:
        """Agree (every process) on the step to resume from: the newest step whose parts,
        all of one save, every process can have (its own, or a peer's copy), if it is no
        older than the newest persistent step (process 0's view of it). Each part to be
        restored from is read now (every chunk's checksum checked) and kept for `restore`:
        a damaged one is left out, with a warning, and the choice made again.

        **Arguments:**

        - `persistent_latest`: the newest persistent step this process knows.
        - `step`: only this step (None: the newest).

        **Returns:** the local choice (None: resume from the persistent tier), and the
        newest persistent step every process is to use.
        """
        self._parts.clear()
        mine = [info.to_json() for info in self.tier.pieces()]
        record = json.dumps({"pieces": mine, "persistent": persistent_latest})
        found = [json.loads(r) for r in self._gather("inventory", lambda: record)]
        persistent = found[0]["persistent"]
        pieces = [PieceInfo.from_json(p) for each in found for p in each["pieces"]]
        pieces = [p for p in pieces if p.processes == self.processes and 0 <= p.owner < self.processes]
        while True:
            keepers: dict[tuple[int, str], dict[int, list[int]]] = {}
            for info in pieces:
                keepers.setdefault((info.step, info.token), {}).setdefault(info.owner, []).append(info.holder)
            whole = sorted(save for save, owners in keepers.items() if len(owners) == self.processes)
            wanted = [save for save in whole if step is None or save[0] == step]
            if not wanted or (step is None and persistent is not None and wanted[-1][0] < persistent):
                return None, persistent
            chosen = wanted[-1]
            owners = keepers[chosen]
            sources = {owner: owner if owner in holders else min(holders) for owner, holders in owners.items()}
            reading = [
                info for info in pieces if (info.step, info.token) == chosen and sources[info.owner] == info.holder
            ]

            def verify(reading: list[PieceInfo] = reading) -> str:
                return json.dumps([i.to_json() for i in reading if i.holder == self.me and not self._read_ahead(i)])

            damaged = {PieceInfo.from_json(d) for each in self._gather("verify", verify) for d in json.loads(each)}
            if not damaged:
                complete = [save for save in whole if save <= chosen][-self.max_to_keep :]
                return LocalChoice(chosen[0], chosen[1], sources, complete), persistent
            warnings.warn(
                "The local tier's parts of step "
                + ", ".join(
                    f"{i.step} (process {i.owner}'s, kept by process {i.holder})" for i in sorted(damaged, key=str)
                )
                + " are damaged; they are left out and the step to resume from is chosen again.",
                stacklevel=3,
            )
            pieces = [p for p in pieces if p not in damaged]

    def _read_ahead(self, info: PieceInfo) -> bool:
        """Read the part ``info`` names (every chunk's checksum checked) and keep it for the
        restore that follows: the part is read once. False if it cannot be read whole."""
        try:
            self._parts[(info.owner, info.step, info.token)] = self.tier.read(info.owner, info.step, info.token)
        except CheckpointError:
            return False
        return True

    def _part(self, owner: int, step: int, token: str) -> HostShards:
        """The part ``latest_step`` read ahead, or read now."""
        part = self._parts.pop((owner, step, token), None)
        return part if part is not None else self.tier.read(owner, step, token)

    def _gather(self, phase: str, work: Callable[[], str]) -> list[str]:
        """``work()`` of every process (a phase of a resume), or this one's alone."""
        return Phases("resume").run(phase, work) if self.processes > 1 else [work()]

    def restore(self, choice: LocalChoice, like: PyTree) -> PyTree:
        """Rebuild ``choice``'s step into ``like`` (every process): from this process's own
        piece, else from the peer that keeps a copy of it (whose copy is then kept here
        again). Every process succeeds, or every one raises."""
        source = choice.sources[self.me]
        self._complete = list(choice.complete)
        if self.processes == 1:
            return self._part(self.me, choice.step, choice.token).rebuild(like)
        client = coordination_client()
        phases = Phases("resume")

        own = self._writer.submit(self._part, self.me, choice.step, choice.token) if source == self.me else None

        def serve() -> str:  # while this process reads its own part
            served = [owner for owner, holder in choice.sources.items() if holder == self.me and owner != self.me]
            for owner in served:
                part = self._part(owner, choice.step, choice.token)
                arrays = self.transfers.offer(transfer_id(choice.token, owner, phases.name), part)
                client.key_value_set(f"{phases.name}/{owner}", json.dumps({"leaves": part.leaves, "arrays": arrays}))
            return self.transfers.address if served else ""

        try:
            addresses = phases.run("serve", serve)
        except BaseException:
            if own is not None:
                own.cancel()
            raise
        restored: list[PyTree] = []
        fetched: list[HostShards] = []

        def rebuild() -> str:
            if own is not None:
                part = own.result()
            else:
                described = json.loads(client.blocking_key_value_get(f"{phases.name}/{self.me}", 60_000))
                number = transfer_id(choice.token, self.me, phases.name)
                part = self.transfers.fetch(addresses[source], number, described["leaves"], described["arrays"])
                fetched.append(part)
            restored.append(part.rebuild(like))
            return ""

        try:
            phases.run("rebuild", rebuild)
        finally:
            for owner, holder in choice.sources.items():
                if holder == self.me and owner != self.me:
                    self.transfers.release(transfer_id(choice.token, owner, phases.name))
        for owner, holder in choice.sources.items():
            if holder == self.me and owner != self.me:
                client.key_value_delete(f"{phases.name}/{owner}")
        if fetched:  # this host keeps its own part again, in the background (the next local save waits)
            self._pending = self._executor.submit(
                self.tier.write, self.me, choice.step, choice.token, self.processes, fetched[0]
            )
        return restored[0]
