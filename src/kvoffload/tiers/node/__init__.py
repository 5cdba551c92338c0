"""The node tier: one host-memory pool in shared memory that every engine of a namespace on a machine uses, with a
shared index in the same directory and no server process (docs/node.md). ``spec`` binds it; ``segment`` opens
and checks its files; ``index`` is the scheduler side; ``pool`` and ``handler`` the worker side."""
