"""The tiers under host, one folder each, and the one place both halves assemble them.

- ``spec``: ``TierSpec``, which binds a tier: its configuration section -> its index (scheduler side), its handler
  (worker side) and its copy routes; ``TierContext``, what a tier is made for.
- ``stack``: the configured specs, in lookup order, and the assembly of both halves from them.
- ``registry``: tiers from other packages (the ``kvoffload.tiers`` entry point group, key ``extra_tiers``).
- ``sizing``: the host tier's slot count, which both halves must agree on.
- ``lower/``: what every tier under host shares (block format and codec, breaker, I/O threads, handler skeleton).
- ``disk/``, ``remote/``: kvoffload's own tiers, each with its ``spec``, ``index`` and ``handler``.
"""
