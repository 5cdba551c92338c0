"""A shared store's index whose every call settles before it returns: for tests of *what* it asks and deletes; and
``wait_on_the_step``, the index made to wait for its searches on the step as lookups did before (the controls of
the no-step-waits tests, ``kvoffload bench faults``).

``ProbedIndex`` (remote, object, and third-party tiers built on it) answers lookups later and deletes in the
background, so that no engine step waits on a network. A test of its searches or its budget wants the answer and
the delete now: ``Settled`` asks again after waiting for the answer, and waits for the deletes each call queued.
What the background itself guarantees (pending first, deadlines, bounds) is tested on the plain index.

    class SettledRemoteIndex(Settled, RemoteIndex): ...
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.index.base import LookupResult, PrepareStoreOutput
from kvoffload.keys import OffloadKey
from kvoffload.tiers.lower.probed_index import ProbedIndex

SETTLE_S = 10.0
"""How long a call waits for its search or its deletes before the test fails."""


class Settled(ProbedIndex):
    """A mixin over a ``ProbedIndex`` subclass: lookups answered now, deletes done before each call returns."""

    def lookup(self, keys: Sequence[OffloadKey]) -> LookupResult:
        result = super().lookup(keys)
        for _ in range(4):  # a lookup past a cached run starts one more search at most; 4 asks are plenty
            if not result.pending:
                self._settle()  # an own block found gone is deleted
                return result
            if not self.wait_answers(SETTLE_S):
                raise AssertionError(f"a search had no answer within {SETTLE_S} s")
            result = super().lookup(keys)
        raise AssertionError("a lookup stayed pending after its search was answered")

    def complete_load(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        super().complete_load(keys, success)
        self._settle()

    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        out = super().prepare_store(keys)
        self._settle()
        return out

    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        super().complete_store(keys, success)
        self._settle()

    def reset(self) -> None:
        super().reset()
        self._settle()

    def _settle(self) -> None:
        if not self.deletes.wait_idle(SETTLE_S):
            raise AssertionError(f"deletes still queued after {SETTLE_S} s")


def wait_on_the_step(index: ProbedIndex) -> None:
    """Make ``index``'s lookups wait for their search's answer on the caller's thread, as they did before they
    left the engine step."""
    lookup = index.lookup

    def waiting(keys: Sequence[OffloadKey]) -> LookupResult:
        found = lookup(keys)
        if found.pending:
            index.wait_answers(SETTLE_S)
            found = lookup(keys)
        return found

    index.lookup = waiting  # type: ignore[method-assign]
