"""The private host tier: each rank's own memory (``host_scope`` private, the default). ``spec`` binds it: a
``SlotIndex`` on the scheduler side, a ``HostPool`` and a ``HostCopier`` on each worker."""
