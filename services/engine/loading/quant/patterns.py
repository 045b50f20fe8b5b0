"""Module-name patterns as quantization configs write them (skip lists, compressed-tensors targets)."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ModulePatterns:
    """A list of module patterns; a module matches when any one does.

    ``names``: a module name matches from its start up to a module boundary (``model.layers.1`` covers
    ``model.layers.1.mlp`` but not ``model.layers.11``), or as a dotted suffix (``lm_head``, ``mlp.gate``);
    each is also tried as a regular expression anchored at the start and ending at a boundary, as HF's
    ``modules_to_not_convert`` allows. ``regexes``: compressed-tensors' ``re:`` entries, matched from the
    module's start (``re.match``). ``any_linear``: compressed-tensors' ``Linear`` target (every linear
    layer).
    """

    names: tuple[str, ...] = ()
    regexes: tuple[str, ...] = ()
    any_linear: bool = False

    def __post_init__(self) -> None:
        for pattern in (*self.names, *self.regexes):
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"module pattern {pattern!r} is not a valid regular expression ({e})") from None

    def matches(self, module: str) -> bool:
        return self.match_rank(module) is not None

    def match_rank(self, module: str) -> int | None:
        """How specifically a pattern names ``module``: 0 by name, 1 by ``re:`` entry, 2 as any Linear; None: no
        pattern does. compressed-tensors gives a module to the group that names it most specifically."""
        for name in self.names:
            if module == name or module.endswith("." + name) or re.match(rf"(?:{name})(?:\.|$)", module):
                return 0
        if any(re.match(regex, module) for regex in self.regexes):
            return 1
        return 2 if self.any_linear else None


def string_list(value: object, field: str) -> tuple[str, ...]:
    """A config field that must be a list of strings (None: empty)."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"quantization_config field {field!r} must be a list of strings, got {value!r}")
    return tuple(value)
