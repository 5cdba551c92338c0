"""A store probe that answers when the test opens its gate, and a clock the test moves: what the tests of the
background searches and deletes build on (a store that answers when told, so that "the caller did not wait" is a
fact of the order of events, not of a timing)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvoffload.keys import OffloadKey, offload_key


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class GatedProbe:
    """Answers ``run`` to every search and True to every delete, each once ``gate`` is open (a ``StoreProbe``)."""

    def __init__(self, run: int | None = 0) -> None:
        self.available = True
        self.run = run
        self.gate = threading.Event()
        self.searched: list[tuple[OffloadKey, ...]] = []
        self.deleted: list[tuple[OffloadKey, ...]] = []
        self.raises = False

    def leading_run(self, keys: Sequence[OffloadKey]) -> int | None:
        self.gate.wait()
        self.searched.append(tuple(keys))
        if self.raises:
            raise RuntimeError("a probe bug")
        return self.run

    def delete(self, keys: Sequence[OffloadKey]) -> bool:
        self.gate.wait()
        self.deleted.append(tuple(keys))
        return not self.raises


def keys(n: int, salt: int = 0) -> list[OffloadKey]:
    return [offload_key(bytes([salt, i % 256, i // 256]) * 4, 0) for i in range(n)]  # type: ignore[arg-type]
