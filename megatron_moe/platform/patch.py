"""How an intervention in megatron-core is declared and probed.

`Patch(name, why, apply, still_needed)`: one patch, subclass, class swap or copy of megatron-core code, with a
probe that reads megatron-core's shipped source for the construct it works around (`source`, `source_sha256`).
tests/unit/test_platform.py runs every probe, so an upgrade that makes one unnecessary fails a test.
Inputs: module and attribute names. Outputs: source text or its sha256; no state, nothing applied here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import re
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Patch:
    """One intervention in megatron-core: a process-wide patch (`apply`), or a subclass, class swap or copy that
    its owner applies per model (`apply` None; `why` names the owner)."""

    name: str
    why: str
    apply: Callable[[], None] | None
    still_needed: Callable[[], bool]
    """True while megatron-core still contains the construct this intervention works around or relies on: the
    upgrade alarm (tests/unit/test_platform.py runs every one)."""


def source_sha256(module_name: str, attr: str) -> str:
    """The sha256 of megatron-core's top-level `def attr` / `class attr` block as shipped: the probe of code
    copied from it (a change upstream is a change the copy has not seen)."""
    return hashlib.sha256(source(module_name, attr).encode()).hexdigest()


def source(module_name: str, attr: str | None = None) -> str:
    """megatron-core's source text as shipped (the file, so patches applied here don't hide it).

    With `attr`, only the top-level `def attr` / `class attr` block.
    """
    module = importlib.import_module(module_name)
    with open(inspect.getsourcefile(module)) as f:
        text = f.read()
    if attr is None:
        return text
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if re.match(rf"(def|class) {re.escape(attr)}\b", line)), None)
    if start is None:
        return ""
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or lines[end][0] in " \t)"):
        end += 1
    return "\n".join(lines[start:end])
