"""The disk tier: a slot file per engine and rank in a directory tree (``spec.DiskTierSpec`` binds it).

Scheduler side: ``index`` (``DiskIndex``: which blocks this engine's slot file holds) with ``engine_files`` (the
engine's number and files, at start-up) and ``foreign`` (the other engines' tables, read on a thread). Worker side:
``handler`` (``DiskHandler``) with ``file_io``. Both: ``slot_file`` (the layout), ``paths``, ``tree`` (the directory
tree, checked at start-up) and the shared block format of ``tiers.lower``. The index never imports the handler, nor
the reverse (tests/test_architecture.py)."""
