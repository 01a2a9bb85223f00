"""Host arrays into the values a restore asks for: checked casts, and jax arrays without copies."""

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from .._errors import CastError, warn_at_caller

if TYPE_CHECKING:  # JAX is imported where a restore needs it, not to read a checkpoint
    import jax
    from jax.typing import DTypeLike


def checked_astype(data: np.ndarray, dtype: "DTypeLike", path: str) -> np.ndarray:
    """``data`` cast to ``dtype`` (an explicit ``cast=True``), refusing values that would change
    beyond rounding: integers out of range, NaN or infinities into integers, finite floats
    that overflow. Floats that underflow to zero are cast with a warning."""
    dtype = np.dtype(dtype)
    if data.dtype == dtype:
        return data
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):  # checked below
        out = data.astype(dtype)
    if data.dtype.kind not in "iufc" or not data.size:
        return out
    parts = [np.real(data), np.imag(data)] if data.dtype.kind == "c" else [data]
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        for part in parts:
            if not np.isfinite(part).all():
                raise CastError(
                    f"Leaf {path!r}: cast=True to {dtype.name} met NaN or infinity, which "
                    f"{dtype.name} cannot hold. Restore into a float `like`."
                )
            if part.min() < info.min or part.max() > info.max:
                raise CastError(
                    f"Leaf {path!r}: cast=True to {dtype.name} met values from {part.min()} to "
                    f"{part.max()}, outside [{info.min}, {info.max}]. Restore into a wider `like` "
                    "(with jax_enable_x64 on, or numpy leaves)."
                )
    elif dtype.kind in "fc":
        for before, after in zip(parts, [np.real(out), np.imag(out)] if dtype.kind == "c" else [out]):
            if (np.isfinite(before) & ~np.isfinite(after)).any():
                raise CastError(
                    f"Leaf {path!r}: cast=True to {dtype.name} would turn finite values into "
                    "infinities (they are beyond its range). Restore into a wider `like`."
                )
            if ((before != 0) & (after == 0)).any():
                warn_at_caller(f"Leaf {path!r}: cast=True to {dtype.name} flushed tiny nonzero values to zero.")
    return out


def narrowed(dtype: np.dtype, into_jax: bool) -> str | None:
    """Why JAX would silently narrow ``dtype`` (64-bit data with x64 off), or None."""
    import jax

    if jax.config.read("jax_enable_x64") or not into_jax:
        return None
    if dtype.itemsize < 8 or dtype.kind not in "iufc" or dtype.name == "complex64":
        return None
    return (
        f"{dtype.name} would become {jax.dtypes.canonicalize_dtype(dtype).name} in JAX, since this process has "
        "jax_enable_x64 off. Enable it (jax.config.update('jax_enable_x64', True)), restore into numpy "
        "leaves, or pass cast=True with a 32-bit `like` (the values are checked to fit)"
    )


class Adoption:
    """A host array `Adoptions` makes a jax array of, with others: ``value`` once placed."""

    def __init__(self, data: np.ndarray, sharding: Any):
        self.data, self.sharding = data, sharding
        self.value: Any = None


class Adoptions:
    """Host arrays made jax arrays on their CPU device together, without a copy: one
    ``jax.device_put`` of the list costs less per array than a call per array (a restore
    of many small leaves makes one per leaf). `adopt` hands them here; `place` makes them.

    ```python
    adoptions = Adoptions()
    pending = adopt(data, None, adoptions)  # an Adoption
    adoptions.place()
    pending.value  # the jax array
    ```
    """

    def __init__(self) -> None:
        self.pending: list[Adoption] = []

    def place(self) -> None:
        """Make every pending array; each `Adoption`'s ``value`` is its jax array."""
        import jax

        pending, self.pending = self.pending, []
        if pending:
            placed = jax.device_put([p.data for p in pending], [p.sharding for p in pending])
            for adoption, value in zip(pending, placed):
                adoption.value = value


def adopt(data: np.ndarray, sharding: Any = None, adoptions: Adoptions | None = None) -> "jax.Array | Adoption":
    """``data`` as a jax array; on a CPU device without a copy where possible.

    XLA's CPU client can take over a 64-byte aligned buffer through DLPack, so
    a restore does not hold every leaf twice; ``data`` must not be used after.
    Other devices, and dtypes DLPack lacks (bfloat16, float8, int4), take one
    copy with ``jax.device_put`` (not ``jnp.asarray``, which is slower). With
    ``adoptions``, an array adopted whole onto one CPU device is left to it (an
    `Adoption` is returned): ``jax.device_put`` keeps an aligned buffer too.
    """
    import jax

    if sharding is None:
        device = jax.local_devices()[0] if getattr(jax.config, "jax_default_device", None) is None else None
    else:
        device = next(iter(sharding.device_set)) if len(sharding.device_set) == 1 else None
    if device is not None and device.platform == "cpu" and data.ctypes.data % 64 == 0 and data.flags.c_contiguous:
        plain = jax.sharding.SingleDeviceSharding(device)
        if adoptions is not None and (sharding is None or sharding == plain):
            adoption = Adoption(data, plain)
            adoptions.pending.append(adoption)
            return adoption
        try:
            adopted = jax.dlpack.from_dlpack(data, device=device)
        except BufferError:  # a dtype DLPack cannot describe
            return jax.device_put(data, sharding)
        # A single device's plain sharding is what from_dlpack gives already; any other
        # (a memory kind, a mesh of one device) is a relabelling device_put, not a copy.
        if sharding is None or (
            isinstance(sharding, jax.sharding.SingleDeviceSharding) and adopted.sharding == sharding
        ):
            return adopted
        return jax.device_put(adopted, sharding)
    return jax.device_put(data, sharding)


def default_device() -> Any:
    """The device a jax array goes to when none is named: the configured default device
    (None where that is a platform's name, not a device), else the first local one."""
    import jax

    device = getattr(jax.config, "jax_default_device", None)
    if device is None:
        return jax.local_devices()[0]
    return device if isinstance(device, jax.Device) else None


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype, alignment: int = 64) -> np.ndarray:
    """An uninitialised C-order array whose data starts on an ``alignment`` boundary."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + nbytes].view(dtype).reshape(shape)
