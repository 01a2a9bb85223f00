"""`Retention`: which of a run's committed steps a `CheckpointManager` keeps. No I/O."""

import dataclasses
import math
from collections.abc import Mapping

from .._errors import ArgumentError

# A run's committed steps: step -> the metrics saved with it.
Steps = Mapping[int, Mapping[str, float]]


@dataclasses.dataclass(frozen=True)
class Retention:
    """The manager's retention policy, from its arguments of the same names.

    **Arguments:**

    - `max_to_keep`: keep the newest this many steps (None: keep every step, and
      the other rules are moot)...
    - `keep_every`: ...plus every step divisible by this...
    - `best_metric`, `best_mode` (``"min"``/``"max"``), `keep_best`: ...plus the
      `keep_best` steps with the best ``metrics[best_metric]`` (see `ranked`).

    Raises `ArgumentError` for a count that is not a positive int or None, a mode
    other than ``"min"``/``"max"``, or `keep_best` without `best_metric`.

    ```python
    retention = Retention(max_to_keep=2, keep_every=5)
    retention.kept({s: {} for s in range(12)})  # {0, 5, 10, 11}
    ```
    """

    max_to_keep: int | None = None
    keep_every: int | None = None
    best_metric: str | None = None
    best_mode: str = "min"
    keep_best: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_to_keep", "keep_every", "keep_best"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ArgumentError(f"{name} must be a positive int or None, got {value!r}.")
        if self.best_mode not in ("min", "max"):
            raise ArgumentError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}.")
        if self.keep_best is not None and self.best_metric is None:
            raise ArgumentError("keep_best needs best_metric: the name of the metric that ranks steps.")

    def kept(self, steps: Steps) -> set[int]:
        """The steps to keep of ``steps``; retention deletes the others.

        **Arguments:**

        - `steps`: the committed steps, each with the metrics saved with it.

        **Returns:** a subset of ``steps``: all of them without `max_to_keep`; else
        the newest `max_to_keep`, every multiple of `keep_every`, and the
        `keep_best` first of `ranked`. Keeping is stable: a step dropped from a
        set is dropped from any larger one, so applying the rule after each save
        keeps what applying it once to all the steps would.

        ```python
        Retention(max_to_keep=1, best_metric="loss", keep_best=1).kept({1: {"loss": 0.5}, 2: {"loss": 0.7}})  # {1, 2}
        ```
        """
        newest_first = sorted(steps, reverse=True)
        if self.max_to_keep is None:
            return set(newest_first)
        kept = set(newest_first[: self.max_to_keep])
        if self.keep_every is not None:
            kept |= {s for s in newest_first if s % self.keep_every == 0}
        if self.keep_best is not None:
            kept |= set(self.ranked(steps)[: self.keep_best])
        return kept

    def ranked(self, steps: Steps) -> list[int]:
        """The steps that have ``best_metric``, the best first.

        **Arguments:**

        - `steps`: the committed steps, each with the metrics saved with it.

        **Returns:** a list of steps: the lowest ``metrics[best_metric]`` first for
        ``best_mode="min"``, the highest for ``"max"``; of equal values the newer
        first; NaN last. Empty without `best_metric`.

        ```python
        Retention(best_metric="acc", best_mode="max").ranked({1: {"acc": 0.5}, 2: {"acc": 0.7}, 3: {}})  # [2, 1]
        ```
        """
        metric = self.best_metric
        if metric is None:
            return []
        sign = 1.0 if self.best_mode == "min" else -1.0

        def rank(step: int) -> tuple[bool, float, int]:
            value = steps[step][metric]
            return (math.isnan(value), 0.0 if math.isnan(value) else sign * value, -step)

        return sorted((s for s, m in steps.items() if metric in m), key=rank)
