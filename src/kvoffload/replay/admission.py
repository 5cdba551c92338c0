"""Store admission for replay: the manager's admission rules (``kvoffload.manager.admission``) by name.

Replay asks the rule, per request, how many leading missed blocks to store (the rule records the sighting). Until
the manager's admission module exists, only ``all`` (store every missed block) is offered.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from types import ModuleType

from kvoffload import config
from kvoffload.keys import OffloadKey

ADMIT_ALL = "all"


def _module() -> ModuleType | None:
    try:
        return importlib.import_module("kvoffload.manager.admission")
    except ModuleNotFoundError:
        return None


def admission_names() -> list[str]:
    """The names ``--admission`` accepts (``StoreAdmission`` values, ``all`` first)."""
    kinds = getattr(config, "StoreAdmission", None)
    if kinds is None or _module() is None:
        return [ADMIT_ALL]
    names = [kind.value for kind in kinds]
    return sorted(names, key=lambda name: name != ADMIT_ALL)


def check_admission(name: str) -> str:
    """``name`` if it is one of ``admission_names()``.

    Raises:
        ValueError: it is not (the message lists the known names).
    """
    if name not in admission_names():
        raise ValueError(f"unknown store admission {name!r}; known: {', '.join(admission_names())}")
    return name


def make_admit(name: str, capacity_blocks: int) -> Callable[[Sequence[OffloadKey]], int]:
    """The rule ``name`` for a tier of ``capacity_blocks``: missed keys -> how many leading ones to store.

    Raises:
        ValueError: as ``check_admission``.
    """
    if check_admission(name) == ADMIT_ALL:
        return len
    module = _module()
    assert module is not None  # admission_names lists more than "all" only when it imports
    rule = module.make_admission(config.StoreAdmission(name), capacity_blocks)  # type: ignore[attr-defined]
    admit: Callable[[Sequence[OffloadKey]], int] = rule.admit
    return admit
