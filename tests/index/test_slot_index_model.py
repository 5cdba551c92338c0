"""The host tier index against a reference model: random stores, loads, completions, touches and resets, for every
eviction policy (weighted random runs, and Hypothesis's state machine)."""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from tests.index.workloads import held, keys

from kvoffload.blocks import Medium
from kvoffload.config import EvictionPolicy
from kvoffload.index.base import EventKind, LookupResult
from kvoffload.index.slot_index import SlotIndex
from kvoffload.keys import OffloadKey


class Model:
    """What the index should hold: a state per key (``flight``, ``ready`` or ``doomed``) and pin counts."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.state: dict[OffloadKey, str] = {}
        self.pins: dict[OffloadKey, int] = {}
        self.announced: set[OffloadKey] = set()  # loadable according to the events seen so far

    def ready(self) -> set[OffloadKey]:
        return {k for k, s in self.state.items() if s == "ready"}

    def expected_new(self, ks: list[OffloadKey]) -> list[OffloadKey]:
        return [k for k in dict.fromkeys(ks) if k not in self.state]

    def evictable(self, ks: list[OffloadKey]) -> set[OffloadKey]:
        return {k for k in self.ready() if k not in self.pins and k not in ks}

    def unpin(self, k: OffloadKey, success: bool) -> None:
        self.pins[k] -= 1
        if not success:
            self.state[k] = "doomed"
        if self.pins[k] == 0:
            del self.pins[k]
            if self.state[k] == "doomed":
                del self.state[k]


class HostTierMachine(RuleBasedStateMachine):
    policy = EvictionPolicy.LRU

    def __init__(self) -> None:
        super().__init__()
        self.index = SlotIndex(5, policy=self.policy)
        self.model = Model(5)
        self.stores: list[list[OffloadKey]] = []
        self.loads: list[list[OffloadKey]] = []

    @rule(ids=st.lists(st.integers(0, 7), max_size=5))
    def store(self, ids: list[int]) -> None:
        ks, model = keys(*ids), self.model
        new, evictable = model.expected_new(ks), model.evictable(ks)
        free = model.capacity - len(model.state)
        out = self.index.prepare_store(ks)
        if len(new) > free + len(evictable):
            assert out is None
            return
        assert out is not None and list(out.keys_to_store) == new
        assert set(out.evicted_keys) <= evictable and len(out.evicted_keys) == max(0, len(new) - free)
        for k in out.evicted_keys:
            del model.state[k]
        model.state.update(dict.fromkeys(new, "flight"))
        self.stores.append(new)

    @precondition(lambda self: self.stores)
    @rule(pick=st.integers(0), success=st.booleans())
    def complete_store(self, pick: int, success: bool) -> None:
        ks = self.stores.pop(pick % len(self.stores))
        self.index.complete_store(ks, success)
        for k in ks:
            if success:
                self.model.state[k] = "ready"
            else:
                del self.model.state[k]

    @rule(start=st.integers(0, 7), n=st.integers(0, 4), load=st.booleans())
    def lookup(self, start: int, n: int, load: bool) -> None:
        # Runs of consecutive keys, like the prefixes a scheduler looks up, so that lookups often hit.
        ks, model = keys(*range(start, start + n)), self.model
        hits = next((i for i, k in enumerate(ks) if model.state.get(k) != "ready"), len(ks))
        pending = hits < len(ks) and model.state.get(ks[hits]) == "flight"
        assert self.index.lookup(ks) == LookupResult(hits, pending)
        if load and hits:
            self.index.prepare_load(ks[:hits])
            for k in ks[:hits]:
                model.pins[k] = model.pins.get(k, 0) + 1
            self.loads.append(ks[:hits])

    @precondition(lambda self: self.loads)
    @rule(pick=st.integers(0), success=st.booleans())
    def complete_load(self, pick: int, success: bool) -> None:
        ks = self.loads.pop(pick % len(self.loads))
        self.index.complete_load(ks, success)
        for k in ks:
            self.model.unpin(k, success)

    @rule(ids=st.lists(st.integers(0, 9), max_size=5))
    def touch(self, ids: list[int]) -> None:
        self.index.touch(keys(*ids))

    @rule()
    def reset(self) -> None:
        self.index.reset()
        for k in self.model.ready() - self.model.pins.keys():
            del self.model.state[k]

    @invariant()
    def agrees_with_the_model(self) -> None:
        self.index.check_integrity()
        model = self.model
        assert held(self.index) == len(model.state)
        assert {k for k in keys(*range(12)) if self.index.lookup([k]).hits} == model.ready()
        for event in self.index.take_events():
            assert event.keys and event.medium == Medium.HOST
            if event.kind is EventKind.STORED:
                model.announced.update(event.keys)
            else:
                model.announced.difference_update(event.keys)
        # Doomed keys stay announced until their slot is freed.
        assert model.announced == {k for k, s in model.state.items() if s != "flight"}

    def teardown(self) -> None:
        while self.loads:
            self.complete_load(0, True)
        while self.stores:
            self.complete_store(0, True)
        self.index.reset()
        self.index.check_integrity()
        assert held(self.index) == 0


MACHINES = {kind: type(f"{kind.name}HostTierMachine", (HostTierMachine,), {"policy": kind})
            for kind in EvictionPolicy}
"""The randomized model check, once per eviction policy."""


def drive(machine: HostTierMachine, rng: random.Random, steps: int) -> None:
    """Weighted random operations: Hypothesis picks rules uniformly and resets too often to build up pins."""
    for _ in range(steps):
        op = rng.choices(["store", "complete_store", "lookup", "complete_load", "touch", "reset"],
                         weights=[3, 3, 4, 3, 1, 0.3])[0]
        if op == "store":
            machine.store([rng.randrange(8) for _ in range(rng.randrange(5))])
        elif op == "complete_store" and machine.stores:
            machine.complete_store(rng.randrange(len(machine.stores)), rng.random() < 0.8)
        elif op == "lookup":
            machine.lookup(rng.randrange(8), rng.randrange(5), rng.random() < 0.7)
        elif op == "complete_load" and machine.loads:
            machine.complete_load(rng.randrange(len(machine.loads)), rng.random() < 0.7)
        elif op == "touch":
            machine.touch([rng.randrange(8) for _ in range(3)])
        elif op == "reset":
            machine.reset()
        machine.agrees_with_the_model()
    machine.teardown()


@pytest.mark.parametrize("policy", list(EvictionPolicy), ids=lambda p: p.value)
@pytest.mark.parametrize("seed", range(20))
def test_random_operations_keep_the_index_consistent(policy: EvictionPolicy, seed: int) -> None:
    drive(MACHINES[policy](), random.Random(seed), steps=150)


_SETTINGS = settings(max_examples=25, stateful_step_count=30, deadline=None)
TestHostTierLRU = MACHINES[EvictionPolicy.LRU].TestCase
TestHostTierARC = MACHINES[EvictionPolicy.ARC].TestCase
TestHostTierS3FIFO = MACHINES[EvictionPolicy.S3FIFO].TestCase
TestHostTierTinyLFU = MACHINES[EvictionPolicy.TINYLFU].TestCase
for _case in (TestHostTierLRU, TestHostTierARC, TestHostTierS3FIFO, TestHostTierTinyLFU):
    _case.settings = _SETTINGS
