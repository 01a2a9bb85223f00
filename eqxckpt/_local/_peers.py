"""Peer copies: which processes keep which process's parts (`placement`), and moving a
part's files between processes with JAX's own point-to-point transfer service (`Transfers`).

`jax.experimental.transfer` is used rather than a collective: a transfer involves only
its two processes (a replaced host fetches from one peer while the others wait at no
collective), and a peer that dies mid-transfer makes the receiver's pull fail at once
instead of leaving every process in a collective (`benchmarks/README.md` compares them).
"""

import hashlib
import math
import os
import socket
from collections.abc import Sequence

import jax
import numpy as np

from .._distributed import coordinator_address
from .._errors import CheckpointError


def failure_domain() -> str:
    """What fails together with this process: its slice (where devices name one) and host."""
    slice_index = getattr(jax.local_devices()[0], "slice_index", None)
    return f"{slice_index if slice_index is not None else ''}/{socket.gethostname()}"


def placement(domains: Sequence[str], replicas: int) -> list[list[int]]:
    """For each process, the ``replicas`` other processes that keep copies of its pieces.

    Processes are put in a ring where neighbours are in different failure domains, and
    each one's copies go to the next ones along it: unless one domain holds more than
    half the processes, a process's first copy is in another domain than its own, so
    losing one host or one slice (with every process in it) loses no piece. Every process
    keeps as many copies as it has.

    **Arguments:**

    - `domains`: each process's failure domain (`failure_domain`), by process index.
    - `replicas`: copies of each process's pieces (at most the number of processes - 1).

    **Returns:** ``holders[k]``, the processes keeping process k's copies, nearest first.

    ```python
    placement(["a", "a", "b", "b"], 1)  # [[2], [3], [1], [0]]
    ```
    """
    groups: dict[str, list[int]] = {}
    for process, domain in enumerate(domains):
        groups.setdefault(domain, []).append(process)
    # Largest domain first, laid on every other place of the ring and then the places
    # between: neighbours share a domain only where one holds more than half the processes.
    ordered = [p for group in sorted(groups.values(), key=len, reverse=True) for p in group]
    ring = [0] * len(ordered)
    places = [*range(0, len(ring), 2), *range(1, len(ring), 2)]
    for place, process in zip(places, ordered):
        ring[place] = process
    count = min(replicas, len(ring) - 1)
    position = {process: at for at, process in enumerate(ring)}
    return [[ring[(position[k] + step) % len(ring)] for step in range(1, count + 1)] for k in range(len(domains))]


def transfer_id(*parts: object) -> int:
    """A transfer's number, the same in every process for the same parts."""
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:7], "big")


def _bind_host() -> str:
    """The address peers reach this process at: the one it reaches the coordinator from
    (loopback when the coordinator is on loopback); ``EQXCKPT_TRANSFER_HOST`` overrides it."""
    if host := os.environ.get("EQXCKPT_TRANSFER_HOST"):
        return host
    address = coordinator_address() or "127.0.0.1:0"
    host = address.rsplit(":", 1)[0].strip("[]")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # no packet is sent: this only picks the route
        return probe.getsockname()[0]


class Transfers:
    """This process's transfer server (started on first use), offering and fetching byte
    arrays (the files of a part).

    ```python
    transfers = Transfers()
    transfers.offer(7, files)                     # in the owner: kept until released
    files = transfers.fetch(address, 7, sizes)    # in the peer
    ```
    """

    def __init__(self) -> None:
        self._server = None
        # What each offer sends: the transfer fails if its arrays are freed before it ends.
        self._offered: dict[int, list[jax.Array]] = {}

    def _started(self):
        if self._server is None:
            from jax.experimental import transfer

            host = _bind_host()
            bind = f"[{host}]:0" if ":" in host else f"{host}:0"
            self._server = transfer.start_transfer_server(jax.local_devices()[0].client, bind, [bind])
        return self._server

    @property
    def address(self) -> str:
        """Where peers reach this process's server."""
        return self._started().address()

    def offer(self, numbers: list[int], data: "list[np.ndarray | jax.Array]") -> None:
        """Make ``data`` available as each of the transfers ``numbers`` (one per peer: a
        transfer is pulled once), until `release`. Call before telling the peers. Host
        arrays (flat uint8: bytes, which no device narrows) are put on the device once,
        whatever the peers; a jax array already on it is offered as it is, without a
        copy. The caller bounds what one offer holds."""
        device = jax.local_devices()[0]
        arrays = [jax.device_put(b, device) for b in data if b.size]
        for number in numbers:
            self._started().await_pull(number, arrays)
            self._offered[number] = arrays

    def release(self, number: int) -> None:
        """Forget offer ``number``: its peers have fetched it, or will not."""
        self._offered.pop(number, None)

    def fetch(self, address: str, number: int, sizes: list[int]) -> list[np.ndarray]:
        """The byte arrays that the process at ``address`` offered as transfer ``number``.

        **Arguments:**

        - `address`: the owner's server (`address`).
        - `number`: the transfer.
        - `sizes`: each array's bytes, as offered.

        **Returns:** the arrays, in host memory. Raises `CheckpointError` if the peer died meanwhile.
        """
        return self.fetch_arrays(address, number, [((size,), np.dtype(np.uint8)) for size in sizes])

    def fetch_arrays(
        self, address: str, number: int, specs: list[tuple[tuple[int, ...], np.dtype]]
    ) -> list[np.ndarray]:
        """The arrays the process at ``address`` offered as transfer ``number``, each of
        the shape and dtype ``specs`` gives (as offered: jax arrays of the device's own
        dtypes, or flat bytes), in host memory (a view of the device's buffer on a CPU).
        Raises `CheckpointError` if the peer died meanwhile.

        ```python
        [block] = transfers.fetch_arrays(address, 7, [((256, 64), np.dtype("bfloat16"))])
        ```
        """
        device = jax.local_devices()[0]
        single = jax.sharding.SingleDeviceSharding(device)
        sized = [jax.ShapeDtypeStruct(shape, dtype, sharding=single) for shape, dtype in specs if math.prod(shape)]
        try:
            connection = self._started().connect(address)  # kept until the pull has landed
            pulled = iter(connection.pull(number, sized) if sized else [])
            received = [
                np.asarray(next(pulled)) if math.prod(shape) else np.zeros(shape, dtype) for shape, dtype in specs
            ]
            del connection
        except Exception as e:  # the runtime's error for a connection lost mid-transfer
            raise CheckpointError(f"Fetching from the process at {address} failed: {e}") from e
        return received
