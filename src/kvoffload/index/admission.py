"""Store admission: which of the full blocks a request would store the connector actually stores.

Storing a block costs device-to-host bandwidth and a tier slot that another block then loses; on production chat
traffic most blocks are never read again (three out of four on the Mooncake conversation trace). An admission
rule sees, per request, the keys of the blocks it would store, in prefix order, and says how many leading ones to
store: a block is useless without the blocks before it, so the admitted part is always a prefix. Declined blocks
are not stored now; a later request with the same prefix offers them again.

The scheduler half asks once per block and request (``ConnectorScheduler``), and ``kvoffload replay`` asks with
the blocks a request missed, through ``make_admission``. A rule that learns from lookups (``AdaptiveAdmission``)
also sees each request's prompt keys once, when it is first looked up (``looked_up``). Rules are not thread-safe
(the scheduler half calls them from one thread).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from itertools import filterfalse, takewhile
from zlib import crc32

from kvoffload.config import EvictionPolicy, StoreAdmission
from kvoffload.index.policies.adaptive import EXPERTS, AdaptivePolicy
from kvoffload.index.policies.base import Policy, any_key, consume
from kvoffload.index.policies.registry import make_policy
from kvoffload.index.retention import RetainPolicy
from kvoffload.keys import OffloadKey

SIGHTING_MEMORY = 4
"""``SecondSighting`` remembers this many times the tier's capacity in keys. It must outlast the tier: only a
fraction of the keys it sees are admitted, so a block's second sighting comes long after the tier turned over
(on the conversation trace at 3M tokens, LRU behind a memory of 1, 2, 4 and 8 times the capacity reaches 0.38,
0.48, 0.50 and 0.51 of the offline optimum). Each remembered key costs about 100 bytes, against a slot's
kilobytes to megabytes of KV."""


class Admission(ABC):
    """Decides how many leading blocks of a request's store to keep."""

    __slots__ = ()

    watches_lookups = False
    """Whether ``looked_up`` does anything (callers skip building its keys otherwise)."""

    def looked_up(self, keys: Sequence[OffloadKey]) -> None:  # noqa: B027 (a hook: fixed rules ignore it)
        """A request's prompt blocks, in prefix order, the first time it is looked up (hits and misses alike)."""

    @abstractmethod
    def admit(self, keys: Sequence[OffloadKey]) -> int:
        """Record that ``keys`` were offered for storing and say how many leading ones to store.

        Args:
            keys: the blocks one request would store now, in prefix order (each key's parent precedes it or was
                offered before).
        Returns:
            A count from 0 to ``len(keys)``: store ``keys[:count]``, decline the rest.
        """


class AdmitAll(Admission):
    """Stores every block."""

    __slots__ = ()

    def admit(self, keys: Sequence[OffloadKey]) -> int:
        return len(keys)


class SecondSighting(Admission):
    """Stores a block the second time its key is offered: a block computed once and never again is not stored.

    The memory is the most recently offered ``limit`` keys (an offered key becomes the most recent, admitted or
    not), so it is bounded, and a key seen again within it is admitted. Costs O(len(keys)) per call.

    Args:
        limit: how many keys to remember.
    Raises:
        ValueError: ``limit`` is not positive.
    """

    __slots__ = ("_limit", "_seen")

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"SecondSighting: limit {limit} must be positive")
        self._limit = limit
        self._seen: OrderedDict[OffloadKey, None] = OrderedDict()

    def admit(self, keys: Sequence[OffloadKey]) -> int:
        seen = self._seen
        count = len(list(takewhile(seen.__contains__, keys)))
        seen.update(dict.fromkeys(keys))
        consume(map(seen.move_to_end, keys))
        for _ in range(len(seen) - self._limit):
            seen.popitem(last=False)
        return count

    def __len__(self) -> int:
        """How many keys are remembered."""
        return len(self._seen)


ADAPTIVE_SAMPLE_SLOTS = 8192
"""``AdaptiveAdmission``'s shadow tiers follow at most this many slots each: on a larger tier they follow the keys
whose CRC falls in a sample of the matching rate, so their cost per request and their memory stay bounded whatever
the tier's size, and their hit counts estimate the whole tier's (as SHARDS samples a cache's keys)."""

SWITCH_MARGIN = 0.01
"""The adaptive policy switches experts when another one's recent hits beat the live one's by this fraction, and by
``SWITCH_LEAD`` times the tier's capacity in blocks, at most once per turnover of the tier: a switch costs a pass over
the resident keys and what the old expert learnt, so near-ties and small samples do not flip it."""

SWITCH_LEAD = 0.1
"""See ``SWITCH_MARGIN``: on the 36-request trace of the serving bench, leads of a few blocks flipped the policy
three times and cost a tenth of LRU's hits."""


class _Shadow:
    """A tier of keys only: one eviction policy behind one admission rule; what a tier would hit with that pair."""

    __slots__ = ("_capacity", "_policy", "_rule", "admission", "kind", "score")

    def __init__(self, capacity: int, kind: EvictionPolicy, admission: StoreAdmission) -> None:
        self._capacity = capacity
        self._policy = make_policy(kind, capacity)
        self._rule = make_admission(admission, capacity)
        self.kind, self.admission = kind, admission
        self.score = 0.0
        """Recent hits, decayed (``AdaptiveAdmission`` keeps it)."""

    def serve(self, keys: Sequence[OffloadKey]) -> int:
        """Look ``keys`` up (leading hits), store what the rule admits of the rest, as a tier would; the hits."""
        policy = self._policy
        hits = len(list(takewhile(policy.__contains__, keys)))
        if hits:
            policy.touch_all(reversed(keys[:hits]))
        missed = keys[hits:]
        if missed:
            admitted = missed[:self._rule.admit(missed)]
            new = list(filterfalse(policy.__contains__, dict.fromkeys(admitted)))[:self._capacity]
            over = len(policy) + len(new) - self._capacity
            if over > 0:
                policy.victims(over, any_key)
            policy.insert_all(reversed(new))
        return hits


class AdaptiveAdmission(Admission):
    """Learns which eviction policy and store admission rule the recent traffic rewards, and follows them.

    Shadow tiers of the same capacity (keys only) replay every request's prompt as it is first looked up, one per
    pair of an eviction policy in ``policies`` and an admission rule in ``admissions``. Each counts its hits, decayed
    over ``SIGHTING_MEMORY`` turnovers of the shadow tier. The real tier stores what the best pair of its live
    policy's admits; ``steer``, an ``AdaptivePolicy``, follows the policy of the best pair overall once that pair
    beats the live policy's best by ``SWITCH_MARGIN`` and ``SWITCH_LEAD`` (at most once per turnover of the tier).
    The real tier's own sighting memory sees every offer whichever rule leads, so a switch finds it warm. On a tier
    larger than ``sample_slots`` the shadows follow a sample of the keys (``ADAPTIVE_SAMPLE_SLOTS``). Costs
    O(prompt blocks) per shadow and request, none per decode step.

    Args:
        capacity_blocks: the real tier's capacity.
        policies: the eviction policies to compare (the live one's when nothing is steered).
        admissions: the admission rules to compare (not ``adaptive``).
        steer: the real tier's adaptive policy, switched to the leading expert.
        sample_slots: the most slots a shadow tier follows.
    Raises:
        ValueError: a capacity is not positive, a list is empty or names ``adaptive``, or ``policies`` holds
            experts that nothing is steered among.
    """

    __slots__ = ("_bound", "_decay", "_live", "_quiet", "_real", "_shadows", "_steer", "_turnover")

    watches_lookups = True

    def __init__(self, capacity_blocks: int, policies: Sequence[EvictionPolicy] = (EvictionPolicy.LRU,),
                 admissions: Sequence[StoreAdmission] = (StoreAdmission.ALL, StoreAdmission.SECOND_SIGHTING),
                 steer: AdaptivePolicy | None = None, sample_slots: int = ADAPTIVE_SAMPLE_SLOTS) -> None:
        if capacity_blocks <= 0 or sample_slots <= 0:
            raise ValueError(f"AdaptiveAdmission: capacities {capacity_blocks}, {sample_slots} must be positive")
        if not policies or not admissions or EvictionPolicy.ADAPTIVE in policies \
                or StoreAdmission.ADAPTIVE in admissions:
            raise ValueError("AdaptiveAdmission: compares fixed policies and rules, at least one of each")
        if steer is None and len(policies) > 1:
            raise ValueError("AdaptiveAdmission: several policies to compare, and no adaptive policy to steer")
        rate = min(1.0, sample_slots / capacity_blocks)
        shadow = max(1, round(capacity_blocks * rate))
        # A key is followed when a CRC of it falls below the bound: deterministic (replays repeat), and uniform
        # whatever the keys are (the replay's are small integers).
        self._bound = None if rate >= 1.0 else max(1, int(rate * (1 << 32)))
        self._shadows = [_Shadow(shadow, kind, rule) for kind in dict.fromkeys(policies)
                         for rule in dict.fromkeys(admissions)]
        self._real = SecondSighting(SIGHTING_MEMORY * capacity_blocks)
        self._decay = 1.0 - 1.0 / (SIGHTING_MEMORY * shadow)
        self._steer = steer
        self._live = self._shadows[0]
        """The pair the real tier follows now."""
        self._turnover = shadow
        self._quiet = 0
        """Followed keys since the policy last switched."""

    def looked_up(self, keys: Sequence[OffloadKey]) -> None:
        bound = self._bound
        followed = keys if bound is None else [k for k in keys if crc32(k) < bound]
        if not followed:
            return
        fade = self._decay ** len(followed)
        for shadow in self._shadows:
            shadow.score = shadow.score * fade + shadow.serve(followed)
        self._quiet += len(followed)
        self._choose()

    def _choose(self) -> None:
        kind = self._live.kind
        live = max((s for s in self._shadows if s.kind is kind), key=_score)
        best = max(self._shadows, key=_score)
        if best.kind is not kind and self._quiet >= self._turnover and self._steer is not None \
                and best.score - live.score > max(live.score * SWITCH_MARGIN, SWITCH_LEAD * self._turnover):
            self._steer.follow(best.kind)
            self._quiet = 0
            live = best
        self._live = live

    @property
    def admits_all(self) -> bool:
        """Which rule leads now: every block (True) or second sightings."""
        return self._live.admission is StoreAdmission.ALL

    @property
    def leader(self) -> tuple[EvictionPolicy, StoreAdmission]:
        """The pair the real tier follows now."""
        return self._live.kind, self._live.admission

    def admit(self, keys: Sequence[OffloadKey]) -> int:
        sighted = self._real.admit(keys)
        return len(keys) if self.admits_all else sighted


def _score(shadow: _Shadow) -> float:
    return shadow.score


def make_admission(kind: StoreAdmission, capacity_blocks: int, policy: Policy | None = None) -> Admission:
    """The rule ``kind`` names, for a tier of ``capacity_blocks`` blocks (``SecondSighting`` remembers
    ``SIGHTING_MEMORY * capacity_blocks`` keys).

    Where ``policy``, the tier's eviction policy, is an ``AdaptivePolicy``, the rule is an ``AdaptiveAdmission``
    that steers it among its experts, behind ``kind`` (or, for ``adaptive``, behind every block or second
    sightings, whichever leads).

    Raises:
        ValueError: ``capacity_blocks`` is not positive, or ``kind`` is not a known rule.
    """
    if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or capacity_blocks <= 0:
        raise ValueError(f"make_admission: capacity {capacity_blocks!r} blocks must be a positive integer")
    if isinstance(policy, RetainPolicy):  # hints on: the adaptive policy orders the unretained keys
        policy = policy.inner
    if isinstance(policy, AdaptivePolicy):
        admissions = _FIXED if kind is StoreAdmission.ADAPTIVE else (kind,)
        return AdaptiveAdmission(capacity_blocks, EXPERTS, admissions, steer=policy)
    if kind is StoreAdmission.ALL:
        return AdmitAll()
    if kind is StoreAdmission.SECOND_SIGHTING:
        return SecondSighting(SIGHTING_MEMORY * capacity_blocks)
    if kind is StoreAdmission.ADAPTIVE:
        return AdaptiveAdmission(capacity_blocks)
    raise ValueError(f"make_admission: unknown store admission {kind!r}")


_FIXED = (StoreAdmission.ALL, StoreAdmission.SECOND_SIGHTING)
"""The admission rules ``adaptive`` chooses between."""
