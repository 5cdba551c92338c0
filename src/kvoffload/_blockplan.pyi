from collections.abc import Sequence

def plan(layout: bytes, ids: Sequence[int], slots: Sequence[int], device_sizes: Sequence[int],
         host_sizes: Sequence[int], skip: int, store: bool) -> tuple[bytes, int, int]: ...
