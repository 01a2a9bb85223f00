"""`CheckpointTranslator`: regex rules from a foreign checkpoint's flat names to ours."""

import re
from collections.abc import Callable, Mapping
from typing import Any

from ._transform import TransformError

RuleFn = Callable[..., tuple[str | None, Any]]


class CheckpointTranslator:
    """Translate a flat ``{name: value}`` dict with regex rules.

    Each rule is ``fn(opts, key, value, *groups) -> (new_key, new_value)``. A rule
    matches a whole key, the first matching rule wins, a ``None`` new key drops
    the entry, and keys that no rule matches are an error listing them all.
    Values pass through untouched unless a rule changes them, so `LazyArray`s
    stay lazy.

    ```python
    translator = eqxckpt.CheckpointTranslator()

    @translator.add(r"encoder/block_(\\d+)/(\\w+)")
    def _(opts, key, value, block, name):
        return f"encoder/layers/{int(block)}/{name}", value

    translator.apply({"encoder/block_000/q": q})  # {'encoder/layers/0/q': q}
    ```
    """

    def __init__(self) -> None:
        self._rules: list[tuple[re.Pattern, RuleFn]] = []

    def add(self, pattern: str) -> Callable[[RuleFn], RuleFn]:
        """Decorator registering ``fn`` for keys that fully match ``pattern``."""
        try:
            regex = re.compile(pattern)
        except re.error as e:
            raise TransformError(f"Translator pattern {pattern!r} is not a valid regex: {e}.") from None

        def register(fn: RuleFn) -> RuleFn:
            self._rules.append((regex, fn))
            return fn

        return register

    def apply(self, flat: Mapping[str, Any], **opts: Any) -> dict[str, Any]:
        """Translate every entry; ``opts`` reach each rule as its first argument (a dict)."""
        out: dict[str, Any] = {}
        origin: dict[str, str] = {}
        unmatched = []
        for key, value in flat.items():
            for regex, fn in self._rules:
                match = regex.fullmatch(key)
                if match is None:
                    continue
                try:
                    new_key, new_value = fn(opts, key, value, *match.groups())
                except Exception as e:
                    e.add_note(f"while translating {key!r} with rule {regex.pattern!r}")
                    raise
                if new_key is not None:
                    if new_key in out:
                        raise TransformError(f"Keys {origin[new_key]!r} and {key!r} both translate to {new_key!r}.")
                    out[new_key], origin[new_key] = new_value, key
                break
            else:
                unmatched.append(key)
        if unmatched:
            listed = "\n  ".join(unmatched[:100]) + (
                f"\n  ... and {len(unmatched) - 100} more" if len(unmatched) > 100 else ""
            )
            raise TransformError(
                f"{len(unmatched)} keys match no translation rule:\n  {listed}\nAdd a rule for them (return a None key to drop one)."
            )
        return out
