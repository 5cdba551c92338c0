"""Eviction policies behind one small interface (see ``base.py``)."""

from kvoffload.manager.policies.arc import ARCPolicy
from kvoffload.manager.policies.base import CanEvict, Policy, make_policy
from kvoffload.manager.policies.lru import LRUPolicy

__all__ = ["ARCPolicy", "CanEvict", "LRUPolicy", "Policy", "make_policy"]
