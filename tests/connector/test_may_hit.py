"""ConnectorScheduler.may_hit: whether a waiting request would load asynchronously, asked before its lookup (vLLM
0.34's ``may_load_async``): yes exactly when its first offload block is in a tier, or on its way there."""

from __future__ import annotations

from tests.connector.schedulers import BLOCK, Req, complete, make_scheduler, run_prefill


def prompt(seed: int, blocks: int = 4) -> list[int]:
    return [seed * 1000 + i for i in range(blocks * BLOCK)]


def test_a_request_whose_first_block_is_stored_may_hit_and_then_does() -> None:
    sched = make_scheduler()
    complete(sched, run_prefill(sched, Req("a", prompt(1))))
    sched.request_finished("a")
    again = Req("b", [*prompt(1), 7, 8])

    assert sched.may_hit(again)
    tokens, load_async = sched.get_num_new_matched_tokens(again, 0)
    assert tokens is not None and tokens > 0 and load_async


def test_a_request_with_another_first_block_or_no_full_block_may_not() -> None:
    sched = make_scheduler()
    complete(sched, run_prefill(sched, Req("a", prompt(1))))
    sched.request_finished("a")

    assert not sched.may_hit(Req("b", prompt(2)))  # nothing of it stored
    assert not sched.may_hit(Req("c", prompt(1)[:BLOCK]))  # one block, whose last token the engine computes
    assert sched.get_num_new_matched_tokens(Req("b", prompt(2)), 0) == (0, False)


def test_a_first_block_still_being_stored_may_hit() -> None:
    sched = make_scheduler()
    run_prefill(sched, Req("a", prompt(1)))  # its store job is in flight: nobody reported it yet

    assert sched.may_hit(Req("b", prompt(1)))
    assert sched.get_num_new_matched_tokens(Req("b", prompt(1)), 0) == (None, False)  # ask again: it is coming
