"""Tools for testing kvoffload and third-party tiers: a simulated engine and conformance suites.

- ``sim`` (with ``sim_values``: its requests and page model): a small engine (device block pool with prefix
  caching, requests that arrive, run, finish, get preempted or aborted) that drives both connector halves step by
  step the way vLLM does, writing deterministic per-token KV bytes so every loaded block can be checked bit for bit.
- ``sim_workload``: what a test on that engine needs: an engine over a ready-made layout with its tiers set by
  config keys (``make_engine``), prompts (``tokens``), a run that checks every block after every step
  (``run_checked``, ``run_timed`` with each step's time) and a prompt only the tiers below host hold
  (``pushed_out``).
- ``layouts``: ready-made KV cache layouts (attention, padded, shared buffer, multi-group, Mamba-style).
- ``conformance``: checks any ``TransferHandler`` must pass (``keyed_store_harness``: the harness for a store that
  names blocks by key).
- ``tier_conformance``: checks any tier index (``LowerIndex``) must pass.
- ``policy_conformance``: checks any eviction ``Policy`` must pass.
- ``redis_server``, ``ceph_rgw``: real servers the tests start on loopback: redis-server, and a single-node Ceph
  cluster with radosgw (S3) that can lose its radosgw or its OSD on demand.
- ``fault_proxy``: ``FaultProxy``, a loopback proxy in front of such a server that trickles, freezes, stays
  silent, black-holes connects or answers a huge HTTP body, switched at run time.
- ``settled``: a shared store's index (``ProbedIndex``) whose lookups are answered and deletes done before each
  call returns, for tests of what it asks; ``wait_on_the_step``, the control that makes lookups wait as before.
- ``outputs``: comparing an engine's outputs with and without kvoffload, with the control that makes the
  comparison able to fail (the e2e tests and ``kvoffload demo`` use it).
"""
