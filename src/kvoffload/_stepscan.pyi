from array import array
from collections.abc import Sequence

def scan(num_requests: int, new_block_ids: Sequence[object], computed_tokens: Sequence[int],
         partial: array[int], offset: int) -> tuple[list[int], list[int]]: ...
