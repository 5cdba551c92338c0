"""The remote tier: block values in a Redis-protocol store shared by engines (``spec.RemoteTierSpec`` binds it).

Scheduler side: ``index`` (``RemoteIndex``) with ``probe``. Worker side: ``handler`` (``RemoteHandler``) with
``link``, ``reads``, ``stage`` and ``faults``. Both: ``client`` (connections and value names) and the shared block
format of ``tiers.lower``. The index never imports the handler, nor the reverse (tests/test_architecture.py)."""
