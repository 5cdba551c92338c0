"""Eviction policies behind one small interface (see ``base.py``)."""

from kvoffload.index.policies.adaptive import AdaptivePolicy
from kvoffload.index.policies.arc import ARCPolicy
from kvoffload.index.policies.base import CanEvict, Policy
from kvoffload.index.policies.lru import LRUPolicy
from kvoffload.index.policies.registry import make_policy
from kvoffload.index.policies.s3fifo import S3FIFOPolicy
from kvoffload.index.policies.tinylfu import TinyLFUPolicy

__all__ = ["ARCPolicy", "AdaptivePolicy", "CanEvict", "LRUPolicy", "Policy", "S3FIFOPolicy", "TinyLFUPolicy",
           "make_policy"]
