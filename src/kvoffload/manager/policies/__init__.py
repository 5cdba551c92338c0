"""Eviction policies behind one small interface (see ``base.py``)."""

from kvoffload.manager.policies.adaptive import AdaptivePolicy
from kvoffload.manager.policies.arc import ARCPolicy
from kvoffload.manager.policies.base import CanEvict, Policy
from kvoffload.manager.policies.lru import LRUPolicy
from kvoffload.manager.policies.registry import make_policy
from kvoffload.manager.policies.s3fifo import S3FIFOPolicy
from kvoffload.manager.policies.tinylfu import TinyLFUPolicy

__all__ = ["ARCPolicy", "AdaptivePolicy", "CanEvict", "LRUPolicy", "Policy", "S3FIFOPolicy", "TinyLFUPolicy",
           "make_policy"]
