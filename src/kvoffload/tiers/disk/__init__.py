"""The disk tier: block files in a directory tree (``spec.DiskTierSpec`` binds it).

Scheduler side: ``index`` (``DiskIndex``, the residency of the block files). Worker side: ``handler``
(``DiskHandler``) with ``file_io``. Both: ``tree`` (the directory tree, checked at start-up) and the shared block
format of ``tiers.lower``. The index never imports the handler, nor the reverse (tests/test_architecture.py)."""
