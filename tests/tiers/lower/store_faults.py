"""What the no-step-waits tests of every shared store run (tests/tiers/lower/test_sim_store_faults.py over the
remote tier, tests/tiers/object/test_sim_store_faults.py over the object tier): a simulated engine whose store sits
behind a ``FaultProxy``.

A run stores a prompt, pushes it out of the host, switches the fault on, and sends requests that need the store
(a hit on the stored prompt, a new prompt) beside one the host holds. Every request must finish with the right bytes
(``SimEngine.check_all`` after each step), and no step may take longer than ``STEP_BOUND_S``, a quarter of the
tier's request timeout (``TIMEOUT_MS``): before lookups and deletes left the step, a lookup alone held a step for
the whole timeout (``check_the_bound_catches_a_waiting_step`` is the control). After the fault and the breakers'
cool-down, a prompt stored anew comes back from the store.
"""

from __future__ import annotations

import time

import pytest

from kvoffload.testing.fault_proxy import Fault, FaultProxy
from kvoffload.testing.settled import wait_on_the_step
from kvoffload.testing.sim import SimEngine, Status
from kvoffload.testing.sim_workload import pushed_out, run_timed, tokens

TIMEOUT_MS = 800
"""The tier's connect and request timeouts here."""
STEP_BOUND_S = TIMEOUT_MS / 1000 / 4
"""The longest step allowed under any fault: well under one timeout."""
COOLDOWN_S = 1.0
"""The breakers' cool-down, after which the store is asked again."""


def run_under(engine: SimEngine, proxy: FaultProxy, fault: Fault) -> None:
    """The requests of a run under ``fault``: every one finishes right, no step is longer than the bound."""
    prompt = pushed_out(engine, 1)
    proxy.set(fault)
    hit = engine.add_request("hit", [*prompt, 7])
    new = engine.add_request("new", tokens(16, seed=50))
    local = engine.add_request("local", tokens(16, seed=1012))  # the last filler's prefix: the host has it
    engine.scheduler.take_stats()
    times = run_timed(engine)
    assert {r.status for r in (hit, new, local)} == {Status.FINISHED}
    assert engine.corrupt_blocks == []
    assert max(times) < STEP_BOUND_S, f"a step took {max(times):.3f} s under {fault.name}"
    if fault in (Fault.FREEZE, Fault.SILENT, Fault.BLACKHOLE):  # (a trickled short answer may still come in time)
        assert engine.scheduler.take_stats().unanswered_lookups >= 1  # the new prompt's search: counted, a miss
    proxy.set(Fault.PASS)


def serves_again(engine: SimEngine) -> None:
    """After the fault and the breakers' cool-down, a prompt stored anew comes back from the store."""
    time.sleep(COOLDOWN_S)  # the engine's tiers run on the real clock
    prompt = pushed_out(engine, 2)
    again = engine.add_request("again", [*prompt, 8])
    run_timed(engine)
    assert again.status is Status.FINISHED and again.loaded_tokens == 16 and engine.corrupt_blocks == []


def check_the_bound_catches_a_waiting_step(engine: SimEngine, proxy: FaultProxy) -> None:
    """The control: an index that waits for its search's answer on the step (as lookups did before) is caught."""
    prompt = pushed_out(engine, 1)
    wait_on_the_step(engine.scheduler.index.lower_indexes[0])
    proxy.set(Fault.FREEZE)
    engine.add_request("hit", [*prompt, 7])
    engine.add_request("new", tokens(16, seed=50))  # not remembered: its lookup searches the store
    with pytest.raises(AssertionError, match="a step took"):
        times = run_timed(engine)
        assert max(times) < STEP_BOUND_S, f"a step took {max(times):.3f} s under FREEZE"
    proxy.set(Fault.PASS)
