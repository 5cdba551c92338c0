"""Worker side of the remote tier: copies blocks between the host pool and values in a Redis-protocol store.

The router sends this handler the jobs of (HOST, REMOTE) and (REMOTE, HOST). A store seals each block's host slot bytes
into a value (``tiers.remote.stage.SealStage``: the disk tier's encoding, ``tiers.lower.block_codec``, staged in buffers
it keeps) and sends non-transactional pipelines of ``SET name value NX [EX ttl]``; a load sends pipelines of
``GETRANGE`` that read no more than a value's size (``tiers.remote.reads``) and verifies every value before copying its
payload into the host slot. A job is cut into pipelines of about ``BATCH_BYTES`` of values, and a helper thread per lane
seals (or verifies and copies) one batch while the lane sends (or receives) the next: the copies and checksums hide
behind the network. The workers' client sends a value from its staging buffer straight to the socket
(``tiers.remote.client.connect(values_in_place=True)``). Values are named as ``tiers.remote.client.value_name`` says
(this rank, this namespace, this secret), so an engine only ever reads values of its own namespace and rank (a
replicated namespace's ranks share one name per key, written by rank 0 alone: ``transfer.skip_writes.SkipWrites``).
``SET`` writes a whole value at once, so a half-written value is never read; ``NX`` keeps the first writer's value
(every writer of one name writes the same bytes: the name is the content's key), and a value already there is a
successful store.

Never on the engine step: ``submit`` only queues. Jobs run on two lanes, stores and loads
(``tiers.lower.laned.LanedHandler``: results in submission order, budgets, breaker, fault log).

Failures are outcomes (``tiers.remote.faults``): a missing value (evicted by the server, or its TTL passed), a damaged
or unauthentic one (then deleted, so that the next ``SET NX`` can replace it), a dead, restarted, stalled or full
server, a refused password, a failed TLS handshake: the job fails, the engine recomputes or skips the store, and
each kind is logged once per outage (which only the answer to a job begun after its latest fault ends, whichever
lane reports first: ``_note_answer``). Server faults open ``breaker`` (jobs then fail at once, without I/O, for
the cool-down); an out-of-memory server opens ``store_breaker`` only, since it still serves loads. A server that is
down when the handler is made opens ``breaker`` at once. A job that has not finished ``connect_timeout_s + 2 *
timeout_s`` after it started fails then (``get_finished``, ``wait`` and ``shutdown`` check), and so does every
command it has in flight (``tiers.remote.connection.within``: the lane is free again by then, however slowly the
server answers); no slot is read or written for a job after that (``_owning``); ``shutdown`` waits
``SHUTDOWN_GRACE_S`` at most.

A store that failed after its ``SET`` reached the server (a timeout on the reply) may leave a value that is not
indexed; the scheduler half never loads it, and the server's eviction or the TTL removes it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from kvoffload.blocks import Medium, TransferJob
from kvoffload.config import RemoteTierConfig
from kvoffload.keys import Namespace, OffloadKey
from kvoffload.tiers.lower.block_codec import open_into
from kvoffload.tiers.lower.block_format import CorruptBlockError
from kvoffload.tiers.lower.breaker import CircuitBreaker
from kvoffload.tiers.lower.handler import SHUTDOWN_GRACE_S, LowerJob
from kvoffload.tiers.lower.laned import QUEUED_POLL_S, LanedHandler, Miss, NamedBlock
from kvoffload.tiers.remote.client import rank_prefix
from kvoffload.tiers.remote.connection import within
from kvoffload.tiers.remote.faults import Fault, classify, delete_quietly, raise_first_error
from kvoffload.tiers.remote.link import RemoteLink
from kvoffload.tiers.remote.reads import read_bounded
from kvoffload.tiers.remote.stage import BATCH_BYTES, SealStage, batches, overlapped

if TYPE_CHECKING:
    from kvoffload.transfer.host_pool import HostPool

HOST_TO_REMOTE = (Medium.HOST, Medium.REMOTE)
REMOTE_TO_HOST = (Medium.REMOTE, Medium.HOST)
__all__ = ["HOST_TO_REMOTE", "QUEUED_POLL_S", "REMOTE_TO_HOST", "SHUTDOWN_GRACE_S", "RemoteHandler"]


_Job = LowerJob[NamedBlock]
"""A job's ``start`` is when its lane took it up (None while queued)."""


class _Damaged(Exception):
    """Value ``name`` failed its checks (``error``): the lane deletes it, then the job fails with ``error``."""

    def __init__(self, name: str, error: CorruptBlockError) -> None:
        super().__init__(name)
        self.name, self.error = name, error


class RemoteHandler(LanedHandler[NamedBlock, _Job, Fault]):
    """Host pool <-> values of one rank in a Redis-protocol store. Register it for (HOST, REMOTE) and
    (REMOTE, HOST).

    Args:
        config: the remote tier's settings (servers, timeouts, TTL, breaker settings, secret).
        pool: this worker's host pool; entries are read from and written to the start of its slots.
        namespace: this rank's namespace; its ``fingerprint()`` is written into and checked in every value.
        entry_bytes: payload bytes of one offload block of each KV-cache group
            (``factor * group_block_bytes(g)``).
        client: a redis-py client to use instead of ``tiers.remote.client.connect(config)`` (kept as it is: its retry
            policy and its closing are the caller's).
        clock: monotonic seconds, for job deadlines and the breakers' cool-down.
        batch_bytes: about this many value bytes per pipeline (``tiers.remote.stage.BATCH_BYTES``; at least one value).
    Raises:
        ValueError: an entry does not fit in a host slot, or ``entry_bytes`` is empty or not positive.
        ConfigError: redis-py is not installed.
    """

    store_type = HOST_TO_REMOTE
    load_type = REMOTE_TO_HOST

    def __init__(self, config: RemoteTierConfig, pool: HostPool, namespace: Namespace,
                 entry_bytes: tuple[int, ...], *, client: Any | None = None,
                 clock: Callable[[], float] = time.monotonic, batch_bytes: int = BATCH_BYTES) -> None:
        super().__init__(pool, namespace, entry_bytes, config.secret, clock, tier="remote tier",
                         where=", ".join(config.urls), kinds=Fault, breaker_errors=config.breaker_errors,
                         breaker_cooldown_s=config.breaker_cooldown_s)
        self._prefix = rank_prefix(namespace, self._fmt)  # once: it hashes the namespace (5 us a block otherwise)
        self._ttl_s = config.ttl_s
        self._budget_s = config.connect_timeout_s + 2 * config.timeout_s  # connect, send, answer
        self.store_breaker = CircuitBreaker(config.breaker_errors, config.breaker_cooldown_s, clock,
                                            "remote tier's stores")
        self._link = RemoteLink(config, client)
        # Each lane's helper seals or verifies one batch while the lane sends or receives the next.
        self._helpers = {True: ThreadPoolExecutor(1, "kvoffload-remote-seal"),
                         False: ThreadPoolExecutor(1, "kvoffload-remote-verify")}
        value_bytes = self._fmt.file_bytes(max(entry_bytes))
        self._per_batch = max(1, batch_bytes // value_bytes)
        self._stage = SealStage(self._fmt, self._fingerprint, value_bytes, self._per_batch)
        self._start_up(config.breaker_cooldown_s)

    def _start_up(self, cooldown_s: float) -> None:
        """Probe the server once: one that is absent or refuses us switches the tier off for a cool-down."""
        try:
            self._link.probe()
        except Exception as e:
            self.breaker.trip()
            self.faults.note(classify(e), e, f"the remote tier is off; every remote job fails at once until it "
                                             f"is tried again in {cooldown_s:.0f} s")

    def _block(self, slot: int, key: OffloadKey, nbytes: int) -> NamedBlock:
        return NamedBlock(slot, key, self._prefix + self._fmt.name(key), nbytes)  # = value_name()

    def _new_job(self, job: TransferJob, blocks: list[NamedBlock]) -> _Job:
        return _Job(job, blocks)

    def _close(self) -> None:
        for helper in self._helpers.values():
            helper.shutdown(wait=False)
        self._link.close()  # also breaks a lane out of a socket it is stuck on

    def _classify(self, error: BaseException) -> Fault:
        return classify(error)

    def _budget(self, state: _Job) -> float:
        return self._budget_s

    def _allows(self, state: _Job) -> bool:
        return self.breaker.allow() and (not state.is_store or self.store_breaker.allow())

    def _count(self, fault: Fault) -> None:
        if fault is Fault.FULL:
            self.store_breaker.record(False)  # a full server still serves loads
        elif fault.is_server_fault:
            self.breaker.record(False)

    def _answered(self, state: _Job) -> None:
        self.breaker.record(True)
        if state.is_store:
            self.store_breaker.record(True)

    def _io(self, state: _Job) -> None:
        # Every command of the job ends by its budget, so the lane is free when the job is written off.
        with within(self._budget_s):
            self._store(state) if state.is_store else self._load(state)

    def _store(self, state: _Job) -> None:
        """Seal and send the job's values, one pipeline of ``SET NX`` per batch.

        With more than one batch, the store lane's helper thread seals batch k+1 (copy and CRC, which release the
        GIL) while this thread sends batch k, so the copy hides behind the network.
        """
        client = self._link.client()
        work = batches(state.blocks, self._per_batch)
        if len(work) == 1:
            self._send(client, work[0], self._seal(state, 0, work[0]))
        else:
            overlapped(self._helpers[True], work, functools.partial(self._seal, state),
                       functools.partial(self._send, client), helper_produces=True)
        state.copied = sum(b.nbytes for b in state.blocks)

    def _seal(self, state: _Job, buffer: int, batch: Sequence[NamedBlock]) -> list[memoryview]:
        with self._owning(state):  # the slots are read only while the job still owns them
            return self._stage.seal(buffer, [(b.key, self._slots[b.slot, :b.nbytes]) for b in batch])

    def _send(self, client: Any, batch: Sequence[NamedBlock], values: list[memoryview]) -> None:
        pipe = client.pipeline(transaction=False)
        for block, value in zip(batch, values, strict=True):
            pipe.set(block.name, value, nx=True, ex=self._ttl_s)
        # NX answers None when the value is already there: another engine's identical block, a success.
        raise_first_error(pipe.execute(raise_on_error=False))

    def _load(self, state: _Job) -> None:
        """Read the job's values, one pipeline per batch; verify each and copy its payload into its slot.

        With more than one batch, the load lane's helper thread verifies and copies batch k while this thread
        receives batch k+1. Copies per block: redis-py's hiredis parser makes two (its read buffer into hiredis's,
        that into the reply ``bytes``); the reply is then opened straight into the host slot (``open_into``: for a
        sealed value the decryption is that copy), so the one copy here is the reply into the host slot. No parser
        hands out a buffer it does not own, so that is the fewest redis-py allows (benchmarks/README.md has the
        figures).
        """
        client = self._link.client()
        work = batches(state.blocks, self._per_batch)
        try:
            if len(work) == 1:
                self._copy_in(state, work[0], self._fetch(client, 0, work[0]))
            else:
                overlapped(self._helpers[False], work, functools.partial(self._fetch, client),
                           functools.partial(self._copy_in, state), helper_produces=False)
        except _Damaged as e:
            # Unless it goes, no engine can ever store this block again (SET NX keeps what is there).
            delete_quietly(client, e.name)
            raise e.error from None
        state.copied = sum(b.nbytes for b in state.blocks)

    def _fetch(self, client: Any, _buffer: int, batch: Sequence[NamedBlock]) -> list[bytes]:
        """``batch``'s values, none read past its expected size (``tiers.remote.reads``: planted ones are deleted)."""
        found = read_bounded(client, [(b.name, self._fmt.file_bytes(b.nbytes)) for b in batch])
        if found.damage is not None:
            raise found.damage  # a damaged value, not a server fault
        if found.missing:
            raise Miss()
        return found.values


    def _copy_in(self, state: _Job, batch: Sequence[NamedBlock], values: list[bytes]) -> None:
        """Open every value of ``batch`` into its slot (``tiers.lower.block_codec.open_into``: checked, and decrypted
        with a secret) while the job owns the slots; a failed check fails the whole job, whose slots are then
        dropped."""
        with self._owning(state):
            for block, value in zip(batch, values, strict=True):
                slot = self._slots[block.slot, :block.nbytes].data
                try:
                    open_into(self._fmt, self._fingerprint, block.key, value, slot)
                except CorruptBlockError as e:
                    raise _Damaged(block.name, e) from None
