"""Jobs for the handler tests of a tier named by key (disk, remote, object): a store from host slots to the tier's
keys, a load back, and one job run to its result. Each tier's ``handlers.py`` binds its medium (``TierJobs``)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from kvoffload.blocks import HostBlocks, JobId, Medium, TierBlocks, TransferJob
from kvoffload.keys import OffloadKey
from kvoffload.transfer.base import TransferHandler, TransferResult

Groups = tuple[int, ...] | None

_ids = itertools.count(1)  # one sequence for every tier's tests: a job id is never reused within a run


class TierJobs:
    """Store and load jobs between host slots and the keys of the tier of ``medium``."""

    def __init__(self, medium: Medium, place: Callable[[OffloadKey], int] | None = None) -> None:
        self.medium = medium
        self.place = place
        """A tier addressed by place (the disk tier's slot files): each key's place in the spec's ``slots``."""

    def store(self, slots: tuple[int, ...], ks: tuple[OffloadKey, ...], groups: Groups = None) -> TransferJob:
        groups = groups or (len(slots),)
        return TransferJob(JobId(next(_ids)), HostBlocks(slots, groups), self._tier(ks, groups))

    def load(self, ks: tuple[OffloadKey, ...], slots: tuple[int, ...], groups: Groups = None) -> TransferJob:
        groups = groups or (len(slots),)
        return TransferJob(JobId(next(_ids)), self._tier(ks, groups), HostBlocks(slots, groups))

    def _tier(self, ks: tuple[OffloadKey, ...], groups: tuple[int, ...]) -> TierBlocks:
        places = () if self.place is None else tuple(self.place(k) for k in ks)
        return TierBlocks(self.medium, ks, groups, places)


def run(handler: TransferHandler, job: TransferJob) -> TransferResult:
    """Submit ``job``, wait for it and return its result (which must come exactly once)."""
    assert handler.submit(job)
    handler.wait([job.job_id])
    (result,) = [r for r in handler.get_finished() if r.job_id == job.job_id]
    return result
