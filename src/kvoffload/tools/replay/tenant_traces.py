"""A single-tenant trace turned multi-tenant: ``--trace tenants:N[+flood]:PATH`` (``sweep.load``).

The rule, for any trace (the Mooncake conversation trace has no session ids): a request's session is its second
block (its first when it has one block). Every request of the Mooncake trace starts with the same block, a system
prompt, and a conversation's turns keep their first own block, so the second block names the conversation. A
session's tenant is ``t{h mod N}``, h the first 8 bytes of the BLAKE2b hash of that block's key: the same split on
every run and machine, about N equal parts by sessions (not by requests: long conversations weigh more).

Each tenant's keys are salted (BLAKE2b of the tenant's name and the key), as ``cache_salt`` folds a tenant into
every key: the shared system prompt becomes one block per tenant, and no tenant hits another's blocks.

``+flood`` adds a ``flood`` tenant: before each request, a geometric count of mean 1 of flood requests (seeded,
``random.Random(0)``), so about half the requests, each as long as the request it precedes, of blocks never seen
before or again.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Iterator

from kvoffload.config.values import MAX_TENANTS
from kvoffload.keys import OffloadKey
from kvoffload.tools.replay.synthetic import FLOOD
from kvoffload.tools.replay.trace import Request, Trace, read_trace

PREFIX = "tenants:"
_FLOOD_SUFFIX = "+flood"


def _hash(*parts: bytes) -> bytes:
    return hashlib.blake2b(b"\0".join(parts), digest_size=8).digest()


def session_tenant(request: Request, count: int) -> str:
    """The tenant of ``request``'s session, among ``count`` (the module docstring's rule)."""
    session = request.keys[1] if len(request.keys) > 1 else request.keys[0] if request.keys else b""
    return f"t{int.from_bytes(_hash(session), 'big') % count}"


def assign_sessions(trace: Trace, count: int, flood: bool = False, seed: int = 0) -> Trace:
    """``trace`` with each request given its session's tenant among ``count`` and its keys salted by it; with
    ``flood``, the flood tenant's requests added.

    Raises:
        ValueError: ``count`` is not in 1..``MAX_TENANTS``.
    """
    if not 1 <= count <= MAX_TENANTS:
        raise ValueError(f"tenants: {count} tenants; give 1 to {MAX_TENANTS}")
    salted: dict[tuple[str, OffloadKey], OffloadKey] = {}  # one object per key, as read_trace interns them

    def salt(tenant: str, key: OffloadKey) -> OffloadKey:
        out = salted.get((tenant, key))
        if out is None:
            out = salted[tenant, key] = OffloadKey(_hash(tenant.encode(), key))
        return out

    def requests() -> Iterator[Request]:
        rng, floods = random.Random(seed), itertools.count()
        for r in trace.requests:
            while flood and rng.random() < 0.5:
                keys = tuple(OffloadKey(_hash(FLOOD.encode(), next(floods).to_bytes(8, "big"))) for _ in r.keys)
                yield r._replace(keys=keys, tenant=FLOOD)
            tenant = session_tenant(r, count)
            yield r._replace(keys=tuple(salt(tenant, k) for k in r.keys), tenant=tenant)

    return Trace(tuple(requests()), trace.block_tokens)


def tenant_trace(name: str) -> Trace:
    """The trace a ``tenants:N[+flood]:PATH`` argument names.

    Raises:
        ValueError: a malformed name or a bad N. TraceError: as ``read_trace``.
    """
    count_text, sep, path = name.removeprefix(PREFIX).partition(":")
    flood = count_text.endswith(_FLOOD_SUFFIX)
    count_text = count_text.removesuffix(_FLOOD_SUFFIX)
    if not sep or not path or not count_text.isdigit():
        raise ValueError(f"trace {name!r}: expected {PREFIX}N:PATH or {PREFIX}N{_FLOOD_SUFFIX}:PATH, N tenants")
    return assign_sessions(read_trace(path), int(count_text), flood)
