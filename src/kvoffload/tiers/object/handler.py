"""Worker side of the object tier: copies blocks between the host pool and objects of an S3-API bucket.

The router sends this handler the jobs of (HOST, OBJECT) and (OBJECT, HOST). One object holds one block: the shared
tiers' encoding (``tiers.lower.block_codec``: a checked header and the payload, or with a tier secret the payload
sealed by AES-256-GCM), named as ``tiers.object.client`` says (this rank, this namespace, this secret). A store
seals each block's host slot bytes into its request thread's buffer and sends it with ``PutObject``; a load sends a
ranged ``GetObject`` whose answer is received into its request thread's buffer (``tiers.object.body.read_into``: no
copy between the socket and the buffer), no more than the object's expected size plus one byte (a planted 5 GiB
object costs one read of a block), and opens every object from there into its host slot (``open_into``: a plain
object is checked before a byte reaches the slot; a sealed one is decrypted into it and then judged on its tag, so
a failed load's slots hold garbage, and the scheduler drops them). The answer never lands in the slot itself: a
read cannot be stopped at a job's deadline, a copy under ``_owning`` can. A PUT replaces an object whole, so a
half-written object is never read; two engines writing one name write the same block (a name is the content's key).

Jobs run on two lanes, stores and loads (``tiers.lower.laned.LanedHandler``: never on the engine step, results
in submission order, budgets, breaker, fault log). A lane runs its job's requests on a pool of ``io_threads``
threads (S3 serves one object per request, so throughput comes from requests in flight) and then gives the job its
result.

Failures are outcomes (``tiers.object.faults``): a missing object (expired by a lifecycle rule, deleted by its
writer) is a miss; a damaged, foreign or oversized one fails the job and is deleted (so that it is stored again
afresh), but not one whose answer broke off before its announced length (a failed request: the object is fine); a
store that is down, refuses us (403, expired credentials), throttles (503 SlowDown) or hangs (an RGW
whose OSD is down answers nothing) fails the job, each kind logged once per outage. Server faults open
``breaker`` (jobs then fail at once, without I/O, for the cool-down); a timeout, a refusal or throttling opens it
at once, since every next request would meet them. A job that has not finished within its budget
(``connect_timeout_s + 2 * timeout_s``, plus its bytes at ``MIN_RATE``) fails then (``get_finished``, ``wait``
and ``shutdown`` check), and no slot is read or written for it after that (``_owning``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvoffload.blocks import Medium, TransferJob
from kvoffload.config import ObjectTierConfig
from kvoffload.keys import Namespace, OffloadKey
from kvoffload.tiers.lower.block_codec import open_into, seal_into
from kvoffload.tiers.lower.block_format import CorruptBlockError
from kvoffload.tiers.lower.deadline import WATCHDOG, result_by
from kvoffload.tiers.lower.handler import LowerJob
from kvoffload.tiers.lower.laned import LanedHandler, Miss, NamedBlock
from kvoffload.tiers.object.body import read_into
from kvoffload.tiers.object.client import (
    NotAnObjectStore,
    base_prefix,
    check_store,
    connect,
    rank_prefix,
    request_s,
    where_of,
)
from kvoffload.tiers.object.faults import Fault, classify, error_code, is_missing

if TYPE_CHECKING:
    from kvoffload.transfer.host_pool import HostPool

logger = logging.getLogger(__name__)

HOST_TO_OBJECT = (Medium.HOST, Medium.OBJECT)
OBJECT_TO_HOST = (Medium.OBJECT, Medium.HOST)
MIN_RATE = 16 << 20
"""Bytes per second a job may be slower than its fixed budget by: a large job needs time for its bytes."""


@dataclass(eq=False)
class _Job(LowerJob[NamedBlock]):
    budget_s: float = 0.0
    """How long the job may run once its lane took it up."""


class ObjectHandler(LanedHandler[NamedBlock, _Job, Fault]):
    """Host pool <-> objects of one rank in an S3-API bucket. Register it for (HOST, OBJECT) and (OBJECT, HOST).

    Args:
        config: the object tier's settings (bucket, endpoint, timeouts, threads, breaker, secret).
        pool: this worker's host pool; entries are read from and written to the start of its slots.
        namespace: this rank's namespace; its ``fingerprint()`` is written into and checked in every object.
        entry_bytes: payload bytes of one offload block of each KV-cache group.
        client: a boto3 S3 client to use instead of ``tiers.object.client.connect(config)`` (the caller closes it).
        clock: monotonic seconds, for job deadlines and the breaker's cool-down.
    Raises:
        ValueError: an entry does not fit in a host slot, or ``entry_bytes`` is empty or not positive.
        ConfigError: boto3 is not installed.
    """

    store_type = HOST_TO_OBJECT
    load_type = OBJECT_TO_HOST

    def __init__(self, config: ObjectTierConfig, pool: HostPool, namespace: Namespace,
                 entry_bytes: tuple[int, ...], *, client: Any | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(pool, namespace, entry_bytes, config.secret, clock, tier="object tier",
                         where=where_of(config), kinds=Fault,
                         breaker_errors=config.breaker_errors, breaker_cooldown_s=config.breaker_cooldown_s)
        self._bucket = config.bucket
        self._prefix = rank_prefix(config, namespace, self._fmt)
        self._fixed_s = config.connect_timeout_s + 2 * config.timeout_s  # connect, send, answer
        self._request_s = request_s(config)
        self.refused: str | None = None
        """Why the store is not one (the start-up check); then every job fails at once, for good."""
        self._owns_client = client is None  # a caller's client is the caller's to close
        self._client = client if client is not None else connect(config, pool_size=2 * config.io_threads)
        self._requests = {True: ThreadPoolExecutor(config.io_threads, "kvoffload-object-put"),
                          False: ThreadPoolExecutor(config.io_threads, "kvoffload-object-get")}
        self._buffers = threading.local()
        """Each request thread's buffer (``_buffer``)."""
        self.requests = 0
        """Requests sent so far (PUT, GET and DELETE: each costs money on AWS)."""
        self._start_up(config, config.breaker_cooldown_s)

    def _start_up(self, config: ObjectTierConfig, cooldown_s: float) -> None:
        """The start-up check (``client.check_store``) within ``request_s``: a store that is absent, slow or refuses
        us switches the tier off for a cool-down; one that is not a store, for good."""
        at = time.monotonic() + self._request_s
        try:
            future = self._requests[False].submit(check_store, self._client, self._bucket, base_prefix(config),
                                                  where_of(config), at)
            result_by(future, at, "the object tier's start-up check")
        except NotAnObjectStore as e:
            self.refused = str(e)
            logger.error("%s (worker: every object job fails)", e)
        except Exception as e:
            self.breaker.trip()
            self.faults.note(classify(e), e, f"the object tier is off; every object job fails at once until it "
                                             f"is tried again in {cooldown_s:.0f} s")

    def _allows(self, state: _Job) -> bool:
        return self.refused is None and super()._allows(state)

    def _block(self, slot: int, key: OffloadKey, nbytes: int) -> NamedBlock:
        return NamedBlock(slot, key, self._prefix + self._fmt.name(key), nbytes)

    def _new_job(self, job: TransferJob, blocks: list[NamedBlock]) -> _Job:
        nbytes = sum(self._fmt.file_bytes(b.nbytes) for b in blocks)
        return _Job(job, blocks, budget_s=self._fixed_s + nbytes / MIN_RATE)

    def _close(self) -> None:
        for requests in self._requests.values():
            requests.shutdown(wait=False, cancel_futures=True)
        close = getattr(self._client, "close", None) if self._owns_client else None
        if close is not None:
            with contextlib.suppress(Exception):
                close()

    def _classify(self, error: BaseException) -> Fault:
        return classify(error)

    def _budget(self, state: _Job) -> float:
        return state.budget_s

    def _count(self, fault: Fault) -> None:
        if not fault.is_server_fault:
            return
        if fault.at_once:
            self.breaker.trip()
        else:
            self.breaker.record(False)

    def _io(self, state: _Job) -> None:
        self._all(state, self._put if state.is_store else self._get)
        state.copied = sum(b.nbytes for b in state.blocks)

    def _all(self, state: _Job, request: Callable[[_Job, NamedBlock], None]) -> None:
        """``request`` for every block of the job, ``io_threads`` at once, until the first error or the budget.

        Raises:
            The first request's error; TimeoutError when the budget ran out first.
        """
        pool = self._requests[state.is_store]
        futures = [pool.submit(request, state, block) for block in state.blocks]
        assert state.start is not None
        done, pending = wait(futures, timeout=max(0.0, state.budget_s - (self._clock() - state.start)),
                             return_when=FIRST_EXCEPTION)
        for future in pending:
            future.cancel()  # those not begun; a request under way ends at its socket timeout, touching no slot
        errors = [f.exception() for f in futures if f in done and f.exception() is not None]
        first = next((e for e in errors if not isinstance(e, Miss)), errors[0] if errors else None)
        if first is not None:
            raise first
        if pending:
            raise TimeoutError(f"job {state.job.job_id} unanswered after {state.budget_s:.2f} s")

    def _put(self, state: _Job, block: NamedBlock) -> None:
        value = self._buffer(self._fmt.file_bytes(block.nbytes))
        with self._owning(state):  # the slot is read only while the job still owns it
            seal_into(self._fmt, self._fingerprint, block.key, self._slots[block.slot, :block.nbytes].data,
                      memoryview(value))
        self._count_request()
        with WATCHDOG.within(self._deadline(len(value)), f"a PUT of {block.name}"):
            self._client.put_object(Bucket=self._bucket, Key=block.name, Body=value)

    def _get(self, state: _Job, block: NamedBlock) -> None:
        """Read ``block``'s object, at most one byte past its expected size; verify it into its slot.

        Raises:
            Miss: the object is not there.
            CorruptBlockError: it is damaged, foreign, short or too long (and now deleted).
            Exception: the request failed (``faults.classify`` names it; an answer that broke off is
                ``body.AnswerCutShort``, a ``ConnectionError``).
        """
        expected = self._fmt.file_bytes(block.nbytes)
        answer = memoryview(self._buffer(expected + 1))  # an inclusive range: one byte more shows an object too long
        self._count_request()
        try:
            with WATCHDOG.within(self._deadline(expected), f"a GET of {block.name}"):
                body = self._client.get_object(Bucket=self._bucket, Key=block.name,
                                               Range=f"bytes=0-{expected}")["Body"]
                got = read_into(body, answer)
        except Exception as e:
            if is_missing(e):
                raise Miss() from None
            if error_code(e) == "InvalidRange":  # an empty object
                self._delete(block.name)
                raise CorruptBlockError(f"object {block.name} is empty: deleted") from None
            raise
        try:
            with self._owning(state):
                slot = self._slots[block.slot, :block.nbytes].data
                open_into(self._fmt, self._fingerprint, block.key, answer[:got], slot)
        except CorruptBlockError as e:
            # Deleted, so that the next store writes it afresh (a name is the content's key).
            self._delete(block.name)
            raise type(e)(f"object {block.name}: {e}: deleted") from None

    def _buffer(self, nbytes: int) -> bytearray:
        """This request thread's buffer of ``nbytes``, valid until its next request: a PUT's object on its way out,
        a GET's answer on its way in (a thread serves one kind; every block of a handler has one size).

        Kept, not made per object: fresh memory page-faults its way in, and a new buffer and its ``bytes`` copy
        per object measured 1.4 ms a MiB here, nine times the seal itself. A load's answer is read into it, never
        into the host slot: a read still under way when its job has failed at its deadline writes here, and the
        slot (given to another block by then) is written only by the copy under ``_owning``.
        """
        buffer: bytearray | None = getattr(self._buffers, "buffer", None)
        if buffer is None or len(buffer) != nbytes:
            buffer = self._buffers.buffer = bytearray(nbytes)
        return buffer

    def _deadline(self, nbytes: int) -> float:
        """When a request moving ``nbytes`` must have ended (monotonic seconds): ``request_s`` and its bytes at
        ``MIN_RATE``."""
        return time.monotonic() + self._request_s + nbytes / MIN_RATE

    def _count_request(self) -> None:
        with self._lock:  # request threads count at once
            self.requests += 1

    def _delete(self, name: str) -> None:
        """Delete a damaged object; a failure is noted as the fault it is (the job fails anyway)."""
        self._count_request()
        try:
            with WATCHDOG.within(self._deadline(0), f"a DELETE of {name}"):
                self._client.delete_object(Bucket=self._bucket, Key=name)
        except Exception as e:
            self.faults.note(classify(e), e, "a damaged object stays (its next load fails again)")
