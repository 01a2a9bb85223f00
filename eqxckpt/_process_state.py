"""Each process's own small state, saved with a checkpoint and atomically with it: a data
loader's position (a Grain iterator's ``get_state()``), a host random generator's state.
The arrays of a multi-process job are global; these are not, so each process's is kept
apart, under its process index, in the manifest (`ProcessStates`), and given back to the
same process on restore."""

import base64
import binascii
import dataclasses
import json
from typing import Any

from ._errors import ArgumentError, CheckpointError, ManifestError

# A process's state as its JSON takes in the manifest: a position, a seed, a generator's
# state (MT19937's is about 7 KiB), not data...
MAX_STATE_BYTES = 64 * 1024
# ...and all processes' together at most this (so each of 1,024 gets 16 KiB): every
# process knows its share before anything is written, and the manifest stays loadable.
MAX_STATES_BYTES = 16 * 1024 * 1024
# The parse cost a state may take beyond `MAX_PARSE_FACTOR` times its size.
STATE_PARSE_ROOM = 4096
# How deep a state may nest (as metadata: far beyond any real use, far within JSON's stack).
MAX_STATE_DEPTH = 100
# The only types JSON gives back as they were (an IntEnum would come back an int).
_JSON_TYPES = (dict, list, str, int, float, bool, type(None))


def state_limit(processes: int) -> int:
    """The most bytes of JSON a process's state may take in a job of ``processes``."""
    return min(MAX_STATE_BYTES, MAX_STATES_BYTES // max(1, processes))


@dataclasses.dataclass(frozen=True)
class SavedState:
    """One process's state as the manifest holds it: a JSON value, or bytes (base64)."""

    entry: dict[str, Any]

    @classmethod
    def of(cls, value: Any, processes: int = 1) -> "SavedState":
        """``value`` taken now, as a copy: bytes, a JSON value, or an object with
        ``get_state()`` (a Grain iterator: its state is taken here, on the caller's
        thread; a background save then commits it, whatever the caller changes after);
        `ArgumentError` for anything JSON cannot give back as it was, or over
        `state_limit` in a job of ``processes``.

        ```python
        SavedState.of(iterator)   # iterator.get_state(), now
        ```
        """
        if isinstance(value, SavedState):
            return value
        if hasattr(value, "get_state") and callable(value.get_state):
            value = value.get_state()
        if isinstance(value, (bytes, bytearray, memoryview)):
            entry: dict[str, Any] = {"bytes": base64.b64encode(bytes(value)).decode()}
        else:
            _check_json(value)
            try:
                text = json.dumps(value, allow_nan=False)
            except ValueError as e:
                raise ArgumentError(f"process_state must be JSON, but {e}; pass finite numbers, or bytes.") from None
            entry = {"json": json.loads(text)}  # a copy: what the caller changes next is not saved
        from ._manifest import MAX_PARSE_FACTOR, parse_cost  # (which reads these states)

        raw = json.dumps(entry, separators=(",", ":")).encode()
        limit = state_limit(processes)
        if len(raw) > limit:
            raise ArgumentError(
                f"process_state takes {len(raw)} bytes in the manifest, over the {limit} a process of a job of "
                f"{processes} may keep there: keep a position or a seed, and save data as arrays of the tree."
            )
        # No denser than a load parses a manifest (with a little room, within the manifest's
        # own for 1,024 processes: a small state is dense by nature).
        if parse_cost(raw) > MAX_PARSE_FACTOR * len(raw) + STATE_PARSE_ROOM:
            raise ArgumentError(
                f"process_state is {len(raw)} bytes of very many tiny JSON values (a load parsing them would take "
                f"over {MAX_PARSE_FACTOR} times their size): pass it as bytes, or as fewer, larger values."
            )
        return cls(entry)

    def value(self) -> Any:
        """The state as it was given: bytes, or the JSON value."""
        if "bytes" in self.entry:
            return base64.b64decode(self.entry["bytes"], validate=True)
        return self.entry["json"]


def _check_json(value: Any) -> None:
    """Refuse (`ArgumentError`) a state JSON would not give back as it is: other types
    than JSON's own (tuples become lists, an IntEnum an int, numpy scalars fail), keys
    that are not strings, nesting deeper than `MAX_STATE_DEPTH`. Iterative: a deep
    nest is refused here, not by a RecursionError in a later phase of the save."""
    pending: list[tuple[Any, int]] = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        if depth > MAX_STATE_DEPTH:
            raise ArgumentError(f"process_state is nested more than {MAX_STATE_DEPTH} levels deep; flatten it.")
        if type(item) not in _JSON_TYPES:
            raise ArgumentError(
                f"process_state holds {item!r:.100} ({type(item).__name__}), which JSON would not give back as it "
                "is (tuples become lists, enums ints). Pass dicts, lists, str, int, float, bool and None, or bytes."
            )
        if type(item) is dict:
            if bad := [key for key in item if type(key) is not str]:
                raise ArgumentError(
                    f"process_state has a key {bad[0]!r:.100}: JSON keeps only string keys, so it would come back "
                    "as a string. Use string keys."
                )
            pending.extend((v, depth + 1) for v in item.values())
        elif type(item) is list:
            pending.extend((v, depth + 1) for v in item)


@dataclasses.dataclass(frozen=True)
class ProcessStates:
    """The states a checkpoint's processes saved with it: how many processes saved it,
    and each one's state by process index (a process that gave none has none)."""

    processes: int
    states: dict[int, SavedState]

    def to_json(self) -> dict[str, Any]:
        return {"processes": self.processes, "states": {str(k): s.entry for k, s in sorted(self.states.items())}}

    @classmethod
    def from_json(cls, doc: Any, where: str) -> "ProcessStates":
        """``doc`` (a manifest's ``process_states``), validated; `ManifestError` for anything off."""

        def bad(why: str) -> ManifestError:
            return ManifestError(f"The manifest of {where} has process_states that {why}; it is corrupt or crafted.")

        if not isinstance(doc, dict) or set(doc) != {"processes", "states"}:
            raise bad("are not {processes, states}")
        processes, states = doc["processes"], doc["states"]
        if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
            raise bad(f"name {processes!r} processes")
        if not isinstance(states, dict):
            raise bad("hold no object of states")
        parsed: dict[int, SavedState] = {}
        for key, entry in states.items():
            if not (key.isdigit() and str(int(key)) == key and int(key) < processes):
                raise bad(f"have a state for process {key!r} of {processes}")
            if not isinstance(entry, dict) or len(entry) != 1 or not {"json", "bytes"} >= set(entry):
                raise bad(f"have a state for process {key} that is not {{json}} or {{bytes}}")
            if "bytes" in entry:
                try:
                    base64.b64decode(entry["bytes"], validate=True)
                except (binascii.Error, TypeError, ValueError):
                    raise bad(f"have a state for process {key} that is not base64") from None
            parsed[int(key)] = SavedState(entry)
        return cls(processes, parsed)

    def value(self, process: int | None, current: int, count: int, where: str) -> Any:
        """The state process ``process`` saved (None: this process, ``current`` of
        ``count``, which must be as many as saved it).

        **Raises:** `CheckpointError`, saying what to do, where the checkpoint was saved by
        another number of processes and ``process`` is None, or holds no such state.
        """
        if process is None:
            if count != self.processes:
                raise CheckpointError(
                    f"{where} was saved by {self.processes} processes with a state each; this job has {count}, so "
                    f"whose state process {current} resumes from is not known. Say which: from_process=k (0 <= k < "
                    f"{self.processes}), e.g. from_process=jax.process_index() % {self.processes}."
                )
            process = current
        if not isinstance(process, int) or isinstance(process, bool) or not 0 <= process < self.processes:
            raise ArgumentError(f"from_process must be an int in [0, {self.processes}), got {process!r}.")
        saved = self.states.get(process)
        if saved is None:
            raise CheckpointError(f"Process {process} saved no process_state with {where}.")
        return saved.value()


@dataclasses.dataclass(frozen=True)
class OwnState:
    """One process's state as a save takes it: from process ``process`` of ``processes``."""

    process: int
    processes: int
    state: SavedState

    def to_json(self) -> list[Any]:
        return [self.process, self.processes, self.state.entry]

    @staticmethod
    def gathered(found: list[Any]) -> ProcessStates | None:
        """The states of a save's processes from each one's `to_json` (or None), or None if
        none gave one."""
        given = [OwnState(p, n, SavedState(entry)) for p, n, entry in (f for f in found if f is not None)]
        if not given:
            return None
        return ProcessStates(given[0].processes, {own.process: own.state for own in given})


def give_back(target: Any, value: Any) -> Any:
    """Give ``value`` to ``target`` (``target.set_state(value)``: a Grain iterator) and
    return ``target``; `ArgumentError` if it has no ``set_state``."""
    if not (hasattr(target, "set_state") and callable(target.set_state)):
        raise ArgumentError(
            f"process_state must be an object with set_state() (a Grain iterator) to restore into, got "
            f"{type(target).__name__}; read the state itself with manager.process_state()."
        )
    target.set_state(value)
    return target
