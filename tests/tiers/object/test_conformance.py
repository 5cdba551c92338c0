"""ObjectHandler against the transfer-handler conformance suite, in both directions, on a real Ceph RGW
(``testing.keyed_store_harness``: objects the harness plants, objects it reads back, with the administrator's
client). A PUT replaces an object whole; the harness's same-destination pair is two loads into one host slot.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from kvoffload.blocks import BlockSpec, JobId, Medium, TierBlocks
from kvoffload.config import ObjectTierConfig
from kvoffload.keys import OffloadKey
from kvoffload.testing.conformance import ALL_CHECKS, HandlerHarness
from kvoffload.testing.keyed_store_harness import ENTRY, NS, KeyedStoreHarness
from kvoffload.tiers.lower.block_codec import encode_value
from kvoffload.tiers.lower.block_format import PLAIN
from kvoffload.tiers.object.client import rank_prefix
from kvoffload.tiers.object.handler import ObjectHandler
from kvoffload.transfer.base import TransferHandler


class ObjectHarness(KeyedStoreHarness):
    medium = Medium.OBJECT

    def __init__(self, config: ObjectTierConfig, s3: Any) -> None:
        super().__init__()
        self.config = config
        self.s3 = s3
        self._prefix = rank_prefix(config, NS, PLAIN)

    def new_handler(self) -> TransferHandler:
        return ObjectHandler(self.config, self.pool, NS, (ENTRY,))

    def tier_blocks(self, keys: tuple[OffloadKey, ...]) -> BlockSpec:
        return TierBlocks(Medium.OBJECT, keys, (len(keys),))

    def put(self, key: OffloadKey, value: bytes) -> None:
        self.s3.put_object(Bucket=self.config.bucket, Key=self._prefix + PLAIN.name(key), Body=value)

    def get(self, key: OffloadKey) -> bytes | None:
        try:
            answer = self.s3.get_object(Bucket=self.config.bucket, Key=self._prefix + PLAIN.name(key))
        except self.s3.exceptions.NoSuchKey:
            return None
        value: bytes = answer["Body"].read()
        return value


@pytest.mark.parametrize("check", ALL_CHECKS, ids=lambda c: c.__name__)
def test_object_handler_conforms(check: Callable[[HandlerHarness], None], config: ObjectTierConfig,
                                 s3: Any) -> None:
    """``config``'s bucket is fresh: each check's harness counts its keys from 0 again."""
    check(ObjectHarness(config, s3))


def test_the_harness_catches_a_store_that_wrote_other_bytes(config: ObjectTierConfig, s3: Any) -> None:
    """The control: a stored object whose payload differs from the slot's fails ``verify``, so the checks above
    would catch a handler that wrote wrong bytes."""
    harness = ObjectHarness(config, s3)
    handler = harness.new_handler()
    try:
        job = harness.make_job(JobId(2))  # a store
        assert handler.submit(job)
        handler.wait([job.job_id])
        assert [r.success for r in handler.get_finished()] == [True] and harness.verify(job)
        assert isinstance(job.dst, TierBlocks) and job.dst.medium == Medium.OBJECT
        key = job.dst.keys[0]
        harness.put(key, encode_value(PLAIN, NS.fingerprint(), key, memoryview(os.urandom(ENTRY))))
        assert not harness.verify(job)
    finally:
        handler.shutdown()
