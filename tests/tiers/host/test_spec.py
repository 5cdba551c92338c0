"""The host tier as a spec: ``stack.host_spec`` picks private or node from ``host_scope`` (the only place that asks),
and ``stack.build_worker`` makes a worker's pool and every handler over it, each with its routes and the host tier's
guard."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvoffload.blocks import Medium
from kvoffload.canonical import CanonicalKV, canonicalize
from kvoffload.config import OffloadConfig
from kvoffload.index.slot_index import SlotIndex
from kvoffload.keys import Namespace
from kvoffload.testing.layouts import attention_layout
from kvoffload.tiers import stack
from kvoffload.tiers.host.spec import PrivateHostSpec
from kvoffload.tiers.node.handler import NodeCheck
from kvoffload.tiers.node.spec import NodeTierSpec
from kvoffload.tiers.spec import TierContext
from kvoffload.transfer.faults import CorruptFirstLoads, FailFirstLoads
from kvoffload.transfer.host_copier import HostCopier
from kvoffload.transfer.host_pool import HostPool

LAYOUT, MAKE_KV = attention_layout(num_blocks=8, block_size=4)
CONTEXT = TierContext(Namespace("m", "fp16", LAYOUT.describe()), LAYOUT, 1)
DEVICE_ROUTES = ((Medium.DEVICE, Medium.HOST), (Medium.HOST, Medium.DEVICE))


def engine_kv() -> CanonicalKV:
    return canonicalize(LAYOUT, MAKE_KV())


def config(**keys: Any) -> OffloadConfig:
    return OffloadConfig.from_dict({"host_bytes": 1 << 20, **keys})


def handlers_by_route(tiers: stack.WorkerTiers) -> dict[tuple[Medium, Medium], Any]:
    return {route: handler for routes, handler in tiers.handlers for route in routes}


def test_the_host_scope_picks_the_host_spec(node_path: Path) -> None:
    assert type(stack.host_spec(config())) is PrivateHostSpec
    node = stack.host_spec(config(host_scope="node", node_path=str(node_path)))
    assert type(node) is NodeTierSpec and node.shared_by_engines
    assert not stack.host_spec(config()).shared_by_engines


def test_a_private_worker_gets_its_own_pool_and_one_copier_for_both_device_routes() -> None:
    spec = PrivateHostSpec(config())
    assert isinstance(spec.make_index(CONTEXT), SlotIndex)
    tiers = stack.build_worker(config(), CONTEXT, engine_kv())
    routes = handlers_by_route(tiers)
    assert type(tiers.pool) is HostPool and tiers.pool.num_slots == spec.num_slots(CONTEXT)
    assert set(routes) == set(DEVICE_ROUTES) and isinstance(routes[DEVICE_ROUTES[0]], HostCopier)
    assert routes[DEVICE_ROUTES[0]] is routes[DEVICE_ROUTES[1]]
    tiers.handlers[0][1].shutdown()


def test_fault_injection_wraps_the_device_handler_and_the_node_tier_guards_every_handler(
        node_path: Path, tmp_path: Path) -> None:
    keys = {"host_scope": "node", "node_path": str(node_path), "disk_path": str(tmp_path), "disk_bytes": 1 << 20,
            "inject_load_failures": 1, "inject_load_corruption": 1}
    tiers = stack.build_worker(config(**keys), CONTEXT, engine_kv())
    routes = handlers_by_route(tiers)
    assert set(routes) == {*DEVICE_ROUTES, (Medium.HOST, Medium.DISK), (Medium.DISK, Medium.HOST)}
    assert all(isinstance(h, NodeCheck) for h in routes.values())  # the guard is outermost on every route
    device = routes[DEVICE_ROUTES[0]]._inner
    assert isinstance(device, CorruptFirstLoads) and isinstance(device._inner, FailFirstLoads)
    assert isinstance(device._inner._inner, HostCopier)
    for _, handler in tiers.handlers:
        handler.shutdown()


def test_the_node_spec_refuses_to_guard_a_pool_it_did_not_make(node_path: Path) -> None:
    spec = NodeTierSpec(config(host_scope="node", node_path=str(node_path)))
    with pytest.raises(TypeError, match="not this spec's NodePool"):
        spec.guard(HostCopier(engine_kv(), HostPool(4, 1 << 16), 1), HostPool(4, 1 << 16))
