"""The managers ``kvoffload bench manager`` drives (``manager.py``): our ``SlotIndex`` (``OurSide``), the same with
tenants on (``TenantSide``) or retention hints on (``HintSide``), and vLLM's ``CPUOffloadingManager``
(``VllmSide``). Every timed method returns the seconds spent inside the manager's calls; both sides get the very
same key objects."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvoffload.config import EvictionPolicy
from kvoffload.index.base import PrepareStoreOutput
from kvoffload.keys import OffloadKey


class OurSide:
    """Drives ``SlotIndex``; every method returns the seconds spent inside the manager's calls."""

    def __init__(self, capacity: int, policy: EvictionPolicy) -> None:
        from kvoffload.index.slot_index import SlotIndex

        self.manager = SlotIndex(capacity, policy)
        self.name = f"kvoffload {policy.value}"

    def fill(self, keys: Sequence[OffloadKey]) -> None:
        out = self.manager.prepare_store(keys)
        if out is None or len(out.keys_to_store) != len(keys):
            raise RuntimeError("bench manager: kvoffload could not fill its tier")
        self.manager.complete_store(keys)
        self.manager.take_events()

    def lookup(self, keys: Sequence[OffloadKey], reps: int) -> float:
        lookup = self.manager.lookup
        start = time.perf_counter()
        for _ in range(reps):
            lookup(keys)
        return time.perf_counter() - start

    def hits(self, keys: Sequence[OffloadKey]) -> int:
        return self.manager.lookup(keys).hits

    def touch(self, keys: Sequence[OffloadKey], reps: int) -> float:
        touch = self.manager.touch
        start = time.perf_counter()
        for _ in range(reps):
            touch(keys)
        return time.perf_counter() - start

    def load_cycle(self, keys: Sequence[OffloadKey], reps: int) -> tuple[float, float]:
        prepare, complete, clock = self.manager.prepare_load, self.manager.complete_load, time.perf_counter
        prep = done = 0.0
        for _ in range(reps):
            t0 = clock()
            prepare(keys)
            t1 = clock()
            complete(keys)
            t2 = clock()
            prep += t1 - t0
            done += t2 - t1
        return prep, done

    def store_cycle(self, batches: Sequence[Sequence[OffloadKey]]) -> tuple[float, float]:
        prepare, complete, clock = self._prepare_store(), self.manager.complete_store, time.perf_counter
        prep = done = 0.0
        outs = []
        for batch in batches:
            t0 = clock()
            outs.append(prepare(batch))
            prep += clock() - t0
        for batch in batches:
            t0 = clock()
            complete(batch)
            done += clock() - t0
        check_stores(self.name, [None if o is None else len(o.evicted_keys) for o in outs], batches)
        self.manager.take_events()
        return prep, done

    def _prepare_store(self) -> Callable[[Sequence[OffloadKey]], PrepareStoreOutput | None]:
        """What a store calls, timed: the index's ``prepare_store``."""
        return self.manager.prepare_store


class TenantSide(OurSide):
    """``OurSide`` with tenants on: ``tenants`` named tenants and "other", equal shares, stores assigned in turn."""

    def __init__(self, capacity: int, policy: EvictionPolicy, tenants: int) -> None:
        from kvoffload.index.slot_index import SlotIndex
        from kvoffload.index.tenants import TenantBook, TenantPolicy, inner_policies

        names = [f"tenant-{i}" for i in range(tenants)]
        self.book = TenantBook(names)
        shares = [1.0 / (tenants + 1)] * (tenants + 1)
        self.manager = SlotIndex(capacity, TenantPolicy(capacity, shares, inner_policies(policy, capacity),
                                                        self.book))
        self.names = [*names, "other-tenant"]
        self.name = f"kvoffload {policy.value}, {tenants} tenants"

    def fill(self, keys: Sequence[OffloadKey]) -> None:
        size = -(-len(keys) // len(self.names))
        for i, name in enumerate(self.names):  # every tenant at its share, a run of keys each (its requests')
            self.book.assign(keys[i * size:(i + 1) * size], name)
        super().fill(keys)
        self.book.clear()

    def _prepare_store(self) -> Callable[[Sequence[OffloadKey]], PrepareStoreOutput | None]:
        """The scheduler's part with tenants on, timed with the store: each batch the next tenant's."""
        prepare, book, names, turn = self.manager.prepare_store, self.book, self.names, itertools.count()

        def store(batch: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
            book.assign(batch, names[next(turn) % len(names)])
            try:
                return prepare(batch)
            finally:
                book.clear()
        return store


class HintSide(OurSide):
    """``OurSide`` with retention hints on, its policy built as the scheduler builds a tier's (``tier_policy``).

    ``hinted`` False: no request gives a hint, so the wrapper passes every call through (what every deployment
    pays with hints on by default). True: every other request is hinted, the scheduler's ``hold`` timed with its
    store, as ``TenantSide`` times ``assign``: the fill holds every other run of ``request`` keys, the prompt's
    included (the tier starts at its retained cap: half of it), and every other store batch is held, so stores
    retain keys and push the oldest retained ones back to the inner policy.
    """

    RETAIN_S = 3600.0
    """The hint's seconds: far longer than a run, so that no deadline passes while timed."""

    def __init__(self, capacity: int, policy: EvictionPolicy, hinted: bool, request: int) -> None:
        from kvoffload.config.tiers import RetentionConfig
        from kvoffload.index.retention import RetentionBook
        from kvoffload.index.slot_index import SlotIndex
        from kvoffload.index.tier_policies import tier_policy

        self.book = RetentionBook(RetentionConfig().share)
        self.manager = SlotIndex(capacity, tier_policy(None, self.book, policy, capacity, "host"))
        self.hinted, self.request = hinted, request
        self.name = f"kvoffload {policy.value}, hints on, {'every other' if hinted else 'no'} request hinted"

    def fill(self, keys: Sequence[OffloadKey]) -> None:
        if self.hinted:  # from the end, so that the prompt's run (the last) is held
            runs = [keys[max(0, end - self.request):end] for end in range(len(keys), 0, -self.request)]
            for run in reversed(runs[::2]):  # oldest deadline first, as earlier requests would have been held
                self.book.hold(run, self.book.clock() + self.RETAIN_S)
        super().fill(keys)

    def _prepare_store(self) -> Callable[[Sequence[OffloadKey]], PrepareStoreOutput | None]:
        """The scheduler's part with hints on, timed with the store: every other batch held (at its request's
        first lookup, before its store), then stored."""
        prepare, book, turn = self.manager.prepare_store, self.book, itertools.count()
        if not self.hinted:
            return prepare

        def store(batch: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
            if next(turn) % 2 == 0:
                book.hold(batch, book.clock() + self.RETAIN_S)
            return prepare(batch)
        return store


class VllmSide:
    """Drives vLLM's ``CPUOffloadingManager`` the natural way for its API; same return values as ``OurSide``."""

    def __init__(self, capacity: int, policy: EvictionPolicy) -> None:
        from vllm.v1.kv_offload.base import LookupResult, ReqContext
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        # Any: vLLM's OffloadKey is its own NewType of bytes; the very same bytes objects go to both managers.
        self.manager: Any = CPUOffloadingManager(capacity, cache_policy=policy.value, enable_events=True)
        self._context = ReqContext
        self._hit = LookupResult.HIT
        self.ctx = ReqContext(req_id="bench-prompt")
        self.name = f"vLLM {policy.value}"

    def fill(self, keys: Sequence[OffloadKey]) -> None:
        ctx = self._context(req_id="bench-fill")
        out = self.manager.prepare_store(keys, ctx)
        if out is None or len(out.keys_to_store) != len(keys):
            raise RuntimeError("bench manager: vLLM could not fill its tier")
        self.manager.complete_store(keys, ctx)
        list(self.manager.take_events())

    def lookup(self, keys: Sequence[OffloadKey], reps: int) -> float:
        lookup, ctx, hit = self.manager.lookup, self.ctx, self._hit
        start = time.perf_counter()
        for _ in range(reps):
            hits = 0
            for key in keys:
                if lookup(key, ctx) is not hit:
                    break
                hits += 1  # noqa: SIM113 (counting the hits is part of the caller's cost, as in vLLM's loop)
        return time.perf_counter() - start

    def hits(self, keys: Sequence[OffloadKey]) -> int:
        return next((i for i, k in enumerate(keys) if self.manager.lookup(k, self.ctx) is not self._hit), len(keys))

    def touch(self, keys: Sequence[OffloadKey], reps: int) -> float | None:
        touch, ctx = getattr(self.manager, "touch", None), self.ctx
        if touch is None:
            return None  # vLLM 0.34 dropped it: lookup and prepare_load record the access, no call to compare
        start = time.perf_counter()
        for _ in range(reps):
            touch(keys, ctx)
        return time.perf_counter() - start

    def load_cycle(self, keys: Sequence[OffloadKey], reps: int) -> tuple[float, float]:
        prepare, complete, clock, ctx = self.manager.prepare_load, self.manager.complete_load, time.perf_counter, \
            self.ctx
        prep = done = 0.0
        for _ in range(reps):
            t0 = clock()
            prepare(keys, ctx)
            t1 = clock()
            complete(keys, ctx)
            t2 = clock()
            prep += t1 - t0
            done += t2 - t1
        return prep, done

    def store_cycle(self, batches: Sequence[Sequence[OffloadKey]]) -> tuple[float, float]:
        prepare, complete, clock = self.manager.prepare_store, self.manager.complete_store, time.perf_counter
        contexts = [self._context(req_id=f"bench-store-{i}") for i in range(len(batches))]
        prep = done = 0.0
        outs = []
        for batch, ctx in zip(batches, contexts, strict=True):
            t0 = clock()
            outs.append(prepare(batch, ctx))
            prep += clock() - t0
        for batch, ctx in zip(batches, contexts, strict=True):
            t0 = clock()
            complete(batch, ctx)
            done += clock() - t0
        check_stores(self.name, [None if o is None else len(o.evicted_keys) for o in outs], batches)
        list(self.manager.take_events())
        return prep, done


Side = OurSide | VllmSide


def check_stores(name: str, evicted: list[int | None], batches: Sequence[Sequence[OffloadKey]]) -> None:
    """Like for like: every store must have found room by evicting exactly its own size."""
    if any(e is None or e != len(b) for e, b in zip(evicted, batches, strict=True)):
        raise RuntimeError(f"bench manager: {name} did not evict one key per stored key ({evicted[:4]}...)")
