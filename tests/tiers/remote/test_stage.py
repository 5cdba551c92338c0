"""remote_stage: staged values are the block encoding (plain ones byte for byte as ``encode_value`` makes them), and
``overlapped`` runs its two sides in order, two items in flight, and ends cleanly on the first error of either
side."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from kvoffload.auth import TierSecret
from kvoffload.keys import Namespace, OffloadKey, offload_key
from kvoffload.tiers.lower.block_codec import encode_value, open_into
from kvoffload.tiers.lower.block_format import PLAIN, BlockFormat, checksum, encode_header
from kvoffload.tiers.remote.stage import SealStage, batches, overlapped

NS = Namespace(model="m", dtype="bf16", layout="pages=64")
FORMATS = {"plain": PLAIN, "secret": BlockFormat.of(TierSecret("t", b"s" * 32))}


def key(i: int) -> OffloadKey:
    return offload_key(bytes([i]) * 16, 0)  # type: ignore[arg-type]


def by_hand(k: OffloadKey, payload: bytes) -> bytes:
    """The plain block encoding of docs/disk-format.md, put together here part by part: header, payload."""
    return encode_header(NS.fingerprint(), k, len(payload), checksum(payload)) + payload


def opened(fmt: BlockFormat, k: OffloadKey, value: memoryview | bytes, n: int) -> bytes:
    out = bytearray(n)
    open_into(fmt, NS.fingerprint(), k, value, memoryview(out))
    return bytes(out)


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_sealed_values_are_the_block_encoding_and_each_buffer_keeps_its_own(fmt: BlockFormat) -> None:
    rng = np.random.default_rng(1)
    payloads = [rng.integers(-128, 128, n, dtype=np.int8) for n in (96, 40, 96)]  # two groups' sizes
    stage = SealStage(fmt, NS.fingerprint(), fmt.file_bytes(96), per_batch=3)
    first = stage.seal(0, [(key(i), p) for i, p in enumerate(payloads)])
    assert [len(v) for v in first] == [fmt.file_bytes(p.nbytes) for p in payloads]
    expected = [p.tobytes() for p in payloads]
    assert [opened(fmt, key(i), v, p.nbytes) for i, (v, p) in enumerate(zip(first, payloads, strict=True))] == expected
    if fmt.auth is None:  # deterministic: byte for byte the reference encoding
        assert [bytes(v) for v in first] == [by_hand(key(i), e) for i, e in enumerate(expected)]
        assert [encode_value(fmt, NS.fingerprint(), key(i), p.data) for i, p in enumerate(payloads)] == \
            [bytes(v) for v in first]
    kept = [bytes(v) for v in first]
    stage.seal(1, [(key(9), payloads[1])])  # the other buffer: the first batch's views still hold their bytes
    assert [bytes(v) for v in first] == kept
    stage.seal(0, [(key(7), payloads[0])])  # the same buffer again: its first view now holds the new value
    assert opened(fmt, key(7), first[0], 96) == expected[0] and bytes(first[0]) != kept[0]


def test_batches_cut_in_order_with_a_shorter_last_one() -> None:
    assert batches(list(range(5)), 2) == [[0, 1], [2, 3], [4]]
    assert batches(list(range(2)), 5) == [[0, 1]]


@pytest.mark.parametrize("helper_produces", [True, False])
def test_overlapped_consumes_every_product_in_order_with_alternating_buffers(helper_produces: bool) -> None:
    consumed: list[tuple[int, tuple[int, int]]] = []
    in_flight, most = 0, 0
    lock = threading.Lock()

    def produce(buffer: int, item: int) -> tuple[int, int]:
        nonlocal in_flight, most
        with lock:
            in_flight += 1
            most = max(most, in_flight)
        time.sleep(0.002)
        return item * 10, buffer

    def consume(item: int, product: tuple[int, int]) -> None:
        nonlocal in_flight
        time.sleep(0.002)
        consumed.append((item, product))
        with lock:
            in_flight -= 1

    with ThreadPoolExecutor(1) as helper:
        overlapped(helper, list(range(7)), produce, consume, helper_produces=helper_produces)
    assert consumed == [(i, (i * 10, i % 2)) for i in range(7)]
    assert most == 2  # the next item was produced while the previous one was consumed, never a third


class Tracked(ThreadPoolExecutor):
    """One helper thread that counts the tasks submitted and not yet done."""

    def __init__(self) -> None:
        super().__init__(1)
        self.outstanding = 0
        self._count = threading.Lock()

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        with self._count:
            self.outstanding += 1
        future = super().submit(fn, *args, **kwargs)
        future.add_done_callback(self._done)
        return future

    def _done(self, _future: Any) -> None:
        with self._count:
            self.outstanding -= 1


@pytest.mark.parametrize("helper_produces", [True, False])
@pytest.mark.parametrize("failing", ["produce", "consume"])
def test_the_first_error_of_either_side_is_raised_after_the_helper_is_done(helper_produces: bool,
                                                                           failing: str) -> None:
    seen: list[tuple[str, int]] = []

    def produce(buffer: int, item: int) -> int:
        time.sleep(0.005)
        seen.append(("produce", item))
        if failing == "produce" and item == 2:
            raise OSError("produce 2")
        return item

    def consume(item: int, product: Any) -> None:
        time.sleep(0.005)
        seen.append(("consume", item))
        if failing == "consume" and item == 2:
            raise OSError("consume 2")

    with Tracked() as helper:
        with pytest.raises(OSError, match=f"{failing} 2"):
            overlapped(helper, list(range(6)), produce, consume, helper_produces=helper_produces)
        assert helper.outstanding == 0  # no helper task is left running (or queued) once the error is raised
    assert ("consume", 2) not in seen or failing == "consume"
    assert all(i <= 3 for _, i in seen)  # it stopped at the error, not at the end of the work
