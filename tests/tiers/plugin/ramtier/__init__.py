"""``ramtier``: a small tier from "another package", kept in the test suite to prove the plug-in path end to end.

A bounded second memory tier under host: each worker keeps ``capacity_blocks`` offload blocks in a buffer of its
own (``handler.RamSlots``), and the scheduler half indexes them with a ``SlotIndex`` (``index``). It is registered
the way a real package is, by an entry point of the ``kvoffload.tiers`` group naming ``ramtier.spec:RamTierSpec``
(tests/tiers/plugin/conftest.py writes that metadata), and turned on with
``extra_tiers: {"ramtier": {"capacity_blocks": N}}``.

Only this module is shared by both halves: the index never imports the handler (nor torch), the handler never
imports the index.
"""

from __future__ import annotations

from kvoffload.tiers import Medium

MEDIUM = Medium("ramtier")
"""The tier's medium: what its index's specs, events and usage name, and the routes its handler serves."""
