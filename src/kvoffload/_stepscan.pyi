from array import array
from collections.abc import Sequence
from typing import Any, TypeVar

_V = TypeVar("_V")

def scan(num_requests: int, new_block_ids: Sequence[object], computed_tokens: Sequence[int],
         partial: array[int], offset: int) -> tuple[list[int], list[int]]: ...

def common_value(mapping: dict[Any, _V], keys: Sequence[object]) -> _V | None: ...
