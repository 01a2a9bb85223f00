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
# state (MT19937's is about 7 KiB), not data. 1,024 processes at the limit stay within
# the manifest's own.
MAX_STATE_BYTES = 64 * 1024


@dataclasses.dataclass(frozen=True)
class SavedState:
    """One process's state as the manifest holds it: a JSON value, or bytes (base64)."""

    entry: dict[str, Any]

    @classmethod
    def of(cls, value: Any) -> "SavedState":
        """``value`` taken now: bytes, a JSON value, or an object with ``get_state()`` (a
        Grain iterator: its state is taken here, on the caller's thread); `ArgumentError`
        for anything JSON cannot give back as it was, or over `MAX_STATE_BYTES`.

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
            try:
                text = json.dumps(value, allow_nan=False)
            except (TypeError, ValueError, RecursionError) as e:
                raise ArgumentError(
                    f"process_state must be bytes, a JSON value or an object with get_state(); got "
                    f"{type(value).__name__}: {e}."
                ) from None
            if json.loads(text) != value or _has_tuple(value):
                raise ArgumentError(
                    f"process_state {value!r:.100} would not come back from JSON as it is (tuples become lists, "
                    "keys strings). Pass lists and string keys, or bytes."
                )
            entry = {"json": value}
        size = len(json.dumps(entry))
        if size > MAX_STATE_BYTES:
            raise ArgumentError(
                f"process_state takes {size} bytes in the manifest, over the {MAX_STATE_BYTES} a process may keep "
                "there: keep a position or a seed, and save data as arrays of the tree."
            )
        return cls(entry)

    def value(self) -> Any:
        """The state as it was given: bytes, or the JSON value."""
        if "bytes" in self.entry:
            return base64.b64decode(self.entry["bytes"], validate=True)
        return self.entry["json"]


def _has_tuple(value: Any) -> bool:
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, tuple):
            return True
        if isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return False


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
