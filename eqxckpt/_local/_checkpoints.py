"""`LocalCheckpoints`: a `CheckpointManager`'s local tier. Frequent saves of each
process's part to a disk or tmpfs of its own host, copied to peers, and resume from the
newest step every process can restore.

A local save of a step, in every process:

1. its part (`Part`: every leaf as `eqxckpt.save` records it, a global array as the
   blocks this process holds) is taken on the caller's thread, then, in the background,
2. saved as a checkpoint in its own tier (`LocalTier.write`: atomic, checksummed),
3. whose files are sent to the peers that keep copies of it (`placement`), a group
   within the host memory budget at a time, with JAX's transfer service, and kept in
   theirs (phases ``write`` and ``copy``, every process),
4. and once every process has come through ``copy``, the step is complete: retention
   keeps the newest ``max_to_keep`` complete steps of this run and deletes every other part.

Every part of one save carries the save's token (a session agreed at the first local
save, and the step), so a part of another save of the same step (a job that died
before finishing it) is never taken for it; and the lineage of the persistent run it
belongs to (the run's identity, and the newest persistent step then), so a part of a
deleted run, or of another run at the same place, is never restored.
"""

import concurrent.futures
import dataclasses
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jaxtyping import PyTree

from .._distributed import Phases
from .._errors import (
    ArgumentError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ManifestError,
    warn_at_caller,
)
from .._process_state import OwnState, SavedState
from .._read._load import load
from .._read._source import Source
from .._run._steps import RunSteps
from .._window import host_memory_budget
from .._write._save import Part
from ._directory import LocalTier, PartInfo
from ._peers import Transfers, failure_domain, placement, transfer_id


@dataclasses.dataclass(frozen=True)
class LocalChoice:
    """A step every process can restore from the local tier: the save (``token``) of
    ``step`` and, for each process, the part it restores from (its ``holder``: the
    process that keeps it, itself unless its own was lost)."""

    step: int
    token: str
    parts: dict[int, PartInfo]
    complete: list[tuple[int, str]]  # every save (step, token) every process can restore, up to this one
    persistent: int | None  # the newest persistent step every process is to use


def _session() -> str:
    """A new session: 32 hex digits, the first 16 the time it began (ns), so that of two
    complete saves of one step (a job that saved the step again after resuming from an
    earlier one), the newer sorts last and is the one restored."""
    return f"{time.time_ns():016x}{uuid.uuid4().hex[:16]}"


def _positive(name: str, value: Any, zero: bool = False) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < (0 if zero else 1):
        raise ArgumentError(f"{name} must be a {'non-negative' if zero else 'positive'} int, got {value!r}.")
    return value


def _groups(files: list[tuple[str, np.ndarray]], budget: int) -> list[list[tuple[str, np.ndarray]]]:
    """Files in groups of at most ``budget`` bytes (a larger file alone), in order: what
    one offer holds on the device at a time."""
    groups: list[list[tuple[str, np.ndarray]]] = [[]]
    size = 0
    for key, data in files:
        if groups[-1] and size + data.nbytes > budget:
            groups.append([])
            size = 0
        groups[-1].append((key, data))
        size += data.nbytes
    return groups


class LocalCheckpoints:
    """The local tier of the run whose persistent steps ``steps`` holds.

    **Arguments:**

    - `local_path`: this host's directory for it (a tmpfs or local disk).
    - `steps`: the run's persistent steps (its place names the tier; its identity and
      newest step are each part's lineage).
    - `interval`: save every this many steps.
    - `replicas`: peers keeping a copy of each process's parts.
    - `max_to_keep`: complete steps kept.

    ```python
    local = LocalCheckpoints("/dev/shm/run", steps, interval=50, replicas=1, max_to_keep=1)
    local.save(50, state)
    ```
    """

    def __init__(self, local_path: Any, steps: RunSteps, interval: int, replicas: int, max_to_keep: int):
        self.interval = _positive("local_interval_steps", interval)
        self.replicas = _positive("local_replicas", replicas, zero=True)
        self.max_to_keep = _positive("local_max_to_keep", max_to_keep)
        self.me, self.processes = jax.process_index(), jax.process_count()
        if self.replicas > self.processes - 1 and (self.replicas != 1 or self.processes > 1):
            warn_at_caller(
                f"local_replicas={self.replicas} asks for more copies than the {self.processes - 1} other processes "
                f"of this job can hold: each part is kept by {self.processes - 1} peers.",
            )
        self.steps = steps
        self.tier = LocalTier(local_path, steps.location, self.me)
        self.transfers = Transfers()
        self._session: str | None = None
        self._run: str | None = None
        self._holders: list[list[int]] = [[] for _ in range(self.processes)]
        self._addresses: list[str] = []
        self._complete: list[tuple[int, str]] = []  # (step, token) of the complete saves kept
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="eqxckpt-local")
        self._pending: concurrent.futures.Future | None = None
        self._keeping: concurrent.futures.Future | None = None  # a received copy being kept (`_keep`)
        # Serving this process's files to its peers, while it fetches theirs.
        self._server = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="eqxckpt-local-serve")

    def close(self) -> None:
        """Wait for the save in flight, and let another manager hold this directory."""
        try:
            self.wait()
        finally:
            self.tier.close()

    # -- saving ------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        return step % self.interval == 0

    def save(self, step: int, tree: PyTree, blocking: bool = False, process_state: Any = None) -> None:
        """Save ``tree`` as ``step`` in the local tier (every process, as for `eqxckpt.save`):
        its part is taken now (what `eqxckpt.save` refuses is refused here, with the same
        error), the rest happens in the background unless ``blocking``. Waits for the
        previous local save first and raises its error. ``process_state``: this process's
        own state (`eqxckpt.save`'s), committed with its part."""
        self._saved()  # a restored copy still being kept is written first, in the background
        if self._complete and step <= self._complete[-1][0]:
            raise CheckpointExistsError(
                f"Step {step} is not newer than the local tier's newest step, {self._complete[-1][0]}: each step "
                "is saved once, in order. Resume from latest_step() + 1."
            )
        own = (
            None
            if process_state is None
            else OwnState(self.me, self.processes, SavedState.of(process_state, self.processes))
        )
        part = Part(tree, own_state=own)
        # On the caller's thread (once): processes given different settings all refuse here,
        # at the same save, rather than one waiting at a later phase for a save never made.
        self._join()
        committed = self.steps.committed()
        follows = committed[-1] if committed else None
        if blocking:
            self._kept()  # on this thread: after it, as the executor would have
            self._write(step, part, follows)
        else:
            self._pending = self._executor.submit(self._write, step, part, follows)

    def wait(self) -> None:
        """Wait for the local save in flight (and a restored copy being kept); raise the save's error."""
        self._kept()
        self._saved()

    def _saved(self) -> None:
        """Wait for the local save in flight; raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.result()
            except CheckpointError as e:
                raise type(e)(f"The local tier's save failed: {e}") from e

    def _join(self) -> None:
        """Agree on the session, the run's identity and where copies go (once, at the first
        local save); the run's identity is made (process 0) if it has none yet."""
        if self._session is not None:
            return
        if self.processes == 1:
            self._run = self.steps.run_id(create=True)
            self._session = _session()
            return
        settings = {"local_interval_steps": self.interval, "local_replicas": self.replicas}

        def mine() -> str:
            found: dict[str, Any] = {
                "domain": failure_domain(),
                "address": self.transfers.address if self.replicas else "",
                "settings": settings,
            }
            if self.me == 0:
                found.update(session=_session(), run=self.steps.run_id(create=True))
            return json.dumps(found)

        found = [json.loads(r) for r in Phases("local").run("join", mine)]
        if differing := [(k, f["settings"]) for k, f in enumerate(found) if f["settings"] != settings]:
            raise ArgumentError(
                f"The processes of this job give CheckpointManager different local tier settings: process "
                f"{self.me} has {settings}, process {differing[0][0]} {differing[0][1]}. Give every process the same."
            )
        self._holders = placement([f["domain"] for f in found], self.replicas)
        self._addresses = [f["address"] for f in found]
        self._session, self._run = found[0]["session"], found[0]["run"]

    def _write(self, step: int, part: Part, follows: int | None) -> None:
        assert self._run is not None
        token = f"{self._session}:{step}"
        info = PartInfo(self.me, step, token, self.processes, self._run, follows, self.me)
        if self.processes == 1:
            self.tier.write(info, part)
        else:
            phases = Phases("local")
            phases.run("copy", lambda: self._copy(phases, info, part))
        self._completed(step, token)

    def _copy(self, phases: Phases, info: PartInfo, part: Part) -> None:
        """Write this process's part and send it to its peers, while fetching (and keeping)
        the parts it keeps for others as their owners write and send them."""
        serving = self._server.submit(self._serve, phases, info, self._holders[self.me], f"copy/{self.me}", part)
        try:
            for owner, holders in enumerate(self._holders):
                if self.me in holders:
                    self.tier.receive(owner, info.step, self._fetch(phases, f"copy/{owner}", self._addresses[owner]))
        finally:
            serving.result()

    def _serve(self, phases: Phases, info: PartInfo, peers: list[int], key: str, part: Part | None = None) -> None:
        """Write ``part`` as ``info`` first if given; then offer part ``info``'s files to
        ``peers``, a group within the host memory budget at a time, each group once every
        peer has fetched the one before: the device holds one group, never a second copy
        of the whole part. A failure before the first offer is posted to the peers, who
        raise it at once rather than wait for a group that will not come."""
        try:
            if part is not None:
                self.tier.write(info, part)
            groups = _groups(self.tier.files(info), host_memory_budget()) if peers else []
        except Exception as e:
            if peers:
                phases.post(f"{key}/0", json.dumps({"error": f"{type(e).__name__}: {e}", "type": type(e).__name__}))
            raise
        for at, group in enumerate(groups):
            numbers = [transfer_id(phases.name, key, at, peer) for peer in peers]  # a transfer is pulled once
            self.transfers.offer(numbers, [data for _, data in group])
            try:
                described = {"keys": [k for k, _ in group], "sizes": [d.nbytes for _, d in group]}
                phases.post(f"{key}/{at}", json.dumps({**described, "last": at == len(groups) - 1}))
                for peer in peers:
                    phases.take(f"{key}/{at}/{peer}", f"process {peer}'s receipt of group {at} of {key}")
                # Every peer has it: the coordination service keeps nothing of it.
                for posted in [f"{key}/{at}", *(f"{key}/{at}/{peer}" for peer in peers)]:
                    phases.forget(posted)
            finally:
                for number in numbers:
                    self.transfers.release(number)

    def _fetch(self, phases: Phases, key: str, address: str) -> list[tuple[str, np.ndarray]]:
        """The files a peer serves under ``key`` (`_serve`), every group of them."""
        files: list[tuple[str, np.ndarray]] = []
        at = 0
        while True:
            described = json.loads(phases.take(f"{key}/{at}", f"group {at} of {key}"))
            if "error" in described:  # as its keeper raised it: damaged, deleted meanwhile, or else
                kinds = {kind.__name__: kind for kind in (CorruptCheckpointError, CheckpointNotFoundError)}
                raise kinds.get(described.get("type"), CheckpointError)(
                    f"The part {key} could not be sent: {described['error']}"
                )
            data = self.transfers.fetch(address, transfer_id(phases.name, key, at, self.me), described["sizes"])
            files.extend(zip(described["keys"], data))
            phases.post(f"{key}/{at}/{self.me}", "")
            if described["last"]:
                return files
            at += 1

    def _keep(self, info: PartInfo, files: list[tuple[str, np.ndarray]]) -> None:
        """Keep the copy of this process's part a peer sent (and it was restored from) in
        the background, as its own save would, once every chunk and digest of it passed
        (a restore of some leaves read only theirs); the next local save is written after
        it. A copy that is damaged or cannot be kept is warned about: the peer still keeps
        its own."""

        def keep() -> None:
            try:
                if why := self.tier.unsound(info, files):
                    warn_at_caller(f"Local tier: the copy of step {info.step} sent here was not kept: {why}")
                    return
                self.tier.receive(info.owner, info.step, files)
            except (CheckpointError, OSError) as e:
                warn_at_caller(f"Local tier: the restored copy of step {info.step} was not kept here: {e}")

        self._keeping = self._executor.submit(keep)

    def _kept(self) -> None:
        """Wait until the copy being kept (`_keep`), if any, is."""
        keeping, self._keeping = self._keeping, None
        if keeping is not None:
            keeping.result()

    def _completed(self, step: int, token: str) -> None:
        """The save ``token`` of ``step`` is complete in every process: keep the newest
        complete saves of this run, delete every other part of it (older ones, and those
        of saves that never completed), and the parts of a deleted run, with a warning."""
        self._complete = sorted({save for save in self._complete if save[0] != step} | {(step, token)})
        self._complete = self._complete[-self.max_to_keep :]
        kept = set(self._complete)
        parts = self.tier.parts()
        stale = [info for info in parts if info.run != self._run]
        if stale:
            warn_at_caller(
                f"Local tier: deleted {len(stale)} parts of a run no longer at {self.steps.location} (steps "
                f"{sorted({info.step for info in stale})}) from {self.tier.root}.",
            )
        self.tier.delete([info for info in parts if info in stale or (info.step, info.token) not in kept])

    # -- resuming ----------------------------------------------------------------------

    def choose(
        self, persistent_latest: int | None, step: int | None = None, damaged: frozenset[PartInfo] = frozenset()
    ) -> tuple[LocalChoice | None, int | None]:
        """Agree (every process) on the step to resume from: the newest step of this run
        whose parts, all of one save, every process can have (its own, or a peer's copy),
        if it is no older than the newest persistent step (process 0's view of it). Each
        part's manifest was read to list it; its bytes are checked as `restore` reads them.

        **Arguments:**

        - `persistent_latest`: the newest persistent step this process knows.
        - `step`: only this step (None: the newest).
        - `damaged`: parts a restore found damaged, never chosen.

        **Returns:** the local choice (None: resume from the persistent tier), and the
        newest persistent step every process is to use.
        """

        self._kept()  # listed once kept: chosen from here, never also fetched again

        def inventory() -> str:
            mine = [info.to_json() for info in self.tier.parts()]
            return json.dumps({"parts": mine, "persistent": persistent_latest, "run": self.steps.run_id(create=False)})

        found = [json.loads(r) for r in self._gather("inventory", inventory)]
        persistent, run = found[0]["persistent"], found[0]["run"]
        parts = [PartInfo.from_json(p) for each in found for p in each["parts"]]
        others = [p for p in parts if p.run != run]
        if others and self.me == 0:
            warn_at_caller(
                f"Local tier: {len(others)} parts (steps {sorted({p.step for p in others})}) belong to another or "
                f"a deleted run, not to the run now at {self.steps.location}: they are never restored.",
            )
        parts = [
            p
            for p in parts
            if run is not None
            and p.run == run
            and p.processes == self.processes
            and 0 <= p.owner < self.processes
            and (p.follows is None or (persistent is not None and p.follows <= persistent))
            and p not in damaged
        ]
        keepers: dict[tuple[int, str], dict[int, list[PartInfo]]] = {}
        for info in parts:
            keepers.setdefault((info.step, info.token), {}).setdefault(info.owner, []).append(info)
        whole = sorted(save for save, owners in keepers.items() if len(owners) == self.processes)
        wanted = [save for save in whole if step is None or save[0] == step]
        if not wanted or (step is None and persistent is not None and wanted[-1][0] < persistent):
            return None, persistent
        chosen = wanted[-1]
        reading: dict[int, PartInfo] = {}
        for owner, kept in keepers[chosen].items():  # its own, else the lowest peer's copy
            reading[owner] = next((i for i in kept if i.holder == owner), min(kept, key=lambda i: i.holder))
        complete = [save for save in whole if save <= chosen][-self.max_to_keep :]
        return LocalChoice(chosen[0], chosen[1], reading, complete, persistent), persistent

    def _gather(self, phase: str, work: Callable[[], str]) -> list[str]:
        """``work()`` of every process (a phase of a resume), or this one's alone."""
        return Phases("resume").run(phase, work) if self.processes > 1 else [work()]

    def restore(
        self, choice: LocalChoice, like: PyTree, give: Callable[[Source], None] | None = None, **load_kwargs: Any
    ) -> PyTree:
        """Restore ``choice``'s step into ``like`` (every process), with `eqxckpt.load`'s
        options (``at=``...): each process from its own part, else from the copy a peer
        keeps of it (sent now, restored from as it arrived, then kept here in the
        background). Every process succeeds, or every
        one raises.

        A part whose bytes fail their checks as they are read (chunk checksums, each leaf's
        digest) is set aside, and the step is restored again from another copy of that
        part; if no sound copy is left, every process raises `CorruptCheckpointError` (and
        `latest_step` names an older step from then on).

        **Arguments:**

        - `choice`: what `choose` agreed on.
        - `like`, `load_kwargs`: as for `eqxckpt.load`; ``like``'s shardings must be those
          the step was saved with (each process holds only its own blocks).
        - `give`: called with the part this process restored from (its own state in it),
          before the others are told it succeeded: a failure there is every process's.

        **Returns:** the restored pytree.
        """
        damaged: frozenset[PartInfo] = frozenset()
        while True:
            restored, found = self._restore(choice, like, load_kwargs, give)
            if not found:
                self._complete = list(choice.complete)
                return restored
            damaged |= found
            again, _ = self.choose(choice.persistent, step=choice.step, damaged=damaged)
            if again is None or again.token != choice.token:
                raise CorruptCheckpointError(
                    f"The local tier's step {choice.step} cannot be restored: "
                    + ", ".join(
                        f"process {i.owner}'s part (kept by process {i.holder})" for i in sorted(damaged, key=str)
                    )
                    + " failed its checks, and no sound copy is left. It was set aside: call latest_step() again "
                    "and resume from the step it names."
                )
            choice = again

    def _restore(
        self,
        choice: LocalChoice,
        like: PyTree,
        load_kwargs: dict[str, Any],
        give: Callable[[Source], None] | None = None,
    ) -> tuple[Any, set[PartInfo]]:
        """One try of `restore`: the restored pytree, or the parts (of every process) found
        damaged as they were sent or read, each set aside by the process keeping it."""
        kept = choice.parts[self.me]
        own = dataclasses.replace(kept, holder=self.me)  # where it is restored from: here
        restored: list[PyTree] = []
        received: list[list[tuple[str, np.ndarray]]] = []  # a peer's copy of this process's part
        # A copy restored from memory is held beside the result: at most the host memory budget.
        budget = load_kwargs.get("host_memory_budget") or host_memory_budget()

        def restore() -> str:
            try:
                # Restored from the copy as it arrived, and kept here after (not first, on the way).
                source = self.tier.received(own, received[0]) if received else self.tier.open(own)
                restored.append(load(source, like, **load_kwargs))
                if give is not None:
                    give(source)
                if not received:
                    return "[]"
            except (CorruptCheckpointError, ManifestError) as e:
                if not received:
                    self.tier.set_aside(own, str(e))
                return json.dumps([kept.to_json()])
            self._keep(own, received[0])
            return "[]"

        if self.processes == 1:
            found = [restore()]
        else:
            phases = Phases("resume")
            addresses = phases.run("address", lambda: self.transfers.address if self.replicas else "")

            def copy() -> str:
                """Each process restores, while serving its peers: from its own part, or
                from the copy of it the peer keeping it sends (as it arrives)."""
                found_here = "[]"
                unsent: list[PartInfo] = []
                served = [info for o, info in choice.parts.items() if info.holder == self.me and o != self.me]
                serving = [
                    (info, self._server.submit(self._serve, phases, info, [info.owner], f"restore/{info.owner}"))
                    for info in served
                ]
                try:
                    if kept.holder != self.me:
                        try:
                            files = self._fetch(phases, f"restore/{self.me}", addresses[kept.holder])
                        except CorruptCheckpointError:  # its keeper could not read it: damaged
                            unsent.append(kept)
                        else:
                            if sum(data.nbytes for _, data in files) <= budget:
                                received.append(files)  # restored from as it is, kept after
                            else:  # more than the host memory budget: kept first, then read back
                                self.tier.receive(self.me, kept.step, files)
                                del files
                            found_here = restore()
                    else:
                        found_here = restore()
                finally:
                    for info, future in serving:
                        try:
                            future.result()
                        except CorruptCheckpointError as e:
                            self.tier.set_aside(info, str(e))
                return json.dumps([info.to_json() for info in unsent] + json.loads(found_here))

            found = phases.run("copy", copy)  # every process restored, or every one tries again
        damaged = {PartInfo.from_json(info) for each in found for info in json.loads(each)}
        for info in damaged:
            if info.holder == self.me and info.owner != self.me:  # the copy this process sent
                self.tier.set_aside(info, f"process {info.owner} found its copy damaged")
        return (restored[0] if restored else None), damaged
