"""Agentic traces: concurrent agent sessions of many turns with tool pauses between them, among one-off prompts;
``kvoffload replay --trace agentic[:FIELD=VALUE,...] --sessions`` replays one (``sweep.load``).

What an agent sends: turn n's prompt is turn n-1's prompt, its output and the new tool result (or user text), so
each turn reuses the whole previous prompt, but only after a pause while the tool runs or the user reads. A tier
that evicts by recency loses a session's prefix whenever enough other traffic passes during that pause; a
retention hint (``retain_s``) is how the client tells the tier when it will be back.

The shape (``AgenticSpec``'s fields; every figure drawn from its own seeded ``random.Random``, so a trace is the
same on every run and machine, and the one-off prompts do not move the sessions' draws):

- ``sessions`` slots run agent sessions back to back, so that many are live at once; a new session starts an
  exponential gap (mean ``restart_s``) after the last one ended, the slots staggered over the first minute.
- A session's prompt starts with a system prompt of ``SYSTEM_BLOCKS`` shared by every session (tool definitions),
  then a task of ``TASK_BLOCKS``; each turn adds an output of ``OUTPUT_BLOCKS`` and a tool result of 1 to 16 blocks
  (lognormal, median 3: tool outputs vary from a line to a file). A session has a geometric number of turns of
  mean ``turns_mean`` (at least 2), and ends early when its prompt would pass ``MAX_PROMPT_BLOCKS`` (the context).
- Between turns: the service time (prefill and decode of the output, ``SERVICE_S`` plus the output at
  ``DECODE_TOKENS_PER_S``) and a pause drawn from a lognormal of median ``pause_median_s`` and shape
  ``pause_sigma``, clipped to [``pause_min_s``, ``pause_max_s``]. Why lognormal: a pause is a product of factors
  (a tool's work times its speed, a user's reading times their attention), which makes a lognormal; its tail is
  heavy enough that a few percent of pauses pass ten minutes (sigma 1.5, median 30 s: P(pause > 10 min) is
  about 2.3%, > 1 min 32%), which is where recency loses a session. The clip stands for what a client would do:
  a tool call is retried or given up after half an hour, and under a second is not a pause.
- The hint: every turn but the last (an agent knows when it has answered) carries ``retain_s``, the time to its
  next turn (service plus pause) rounded up to the next whole second: the client's own estimate of its pause, as
  exact as a client that knows its tool's timeout. ``kvoffload replay --sessions`` can put a fixed 600 s in its
  place (a client that knows nothing of its pauses).
- One-off prompts: a Poisson stream of ``oneoff_per_s`` per second, each its own ``ONEOFF_SYSTEM_BLOCKS`` shared
  system prompt (the little reuse a chat front end has) and 1 to 32 new blocks (lognormal, median 6), never seen
  again.

Blocks are ``BLOCK_TOKENS`` tokens and every prompt is whole blocks (a real prompt's partial last block changes with
the next turn, one block per turn that no tier could hit; left out so the figures say what the policy does).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from kvoffload.tools.replay.trace import Request, Trace, int_key

PREFIX = "agentic"
BLOCK_TOKENS = 512
SYSTEM_BLOCKS = 16
"""The agents' shared system prompt: 8k tokens of instructions and tool definitions."""
TASK_BLOCKS = 2
OUTPUT_BLOCKS = 1
MAX_PROMPT_BLOCKS = 256
"""128k tokens: a session whose next prompt would pass it ends (its context is full)."""
ONEOFF_SYSTEM_BLOCKS = 2
SERVICE_S = 1.0
DECODE_TOKENS_PER_S = 50.0
_ONEOFF_SYSTEM = SYSTEM_BLOCKS  # ids SYSTEM_BLOCKS.. are the one-offs' system prompt
_SPACE_BITS = 40
"""A slot's block ids are its index + 1 shifted by this; the one-offs' are past every slot's."""


@dataclass(frozen=True)
class AgenticSpec:
    """The generator's parameters (the module docstring says what each shapes and why its default)."""

    seed: int = 0
    sessions: int = 8
    """Agent sessions live at once: about 800 blocks of live prompts, a fraction of the tiers figured."""
    duration_s: float = 7200.0
    oneoff_per_s: float = 4.0
    """About 45 new blocks a second: a tier of 2,000 blocks turns over in under a minute, shorter than a third of
    the pauses, so recency alone keeps a session's prefix across short pauses only."""
    turns_mean: float = 12.0
    pause_median_s: float = 30.0
    pause_sigma: float = 1.5
    pause_min_s: float = 1.0
    pause_max_s: float = 1800.0
    restart_s: float = 30.0

    def __post_init__(self) -> None:
        if self.sessions < 0 or self.duration_s <= 0 or self.oneoff_per_s < 0 or self.turns_mean < 1:
            raise ValueError(f"agentic trace: sessions >= 0, duration_s > 0, oneoff_per_s >= 0 and turns_mean >= 1 "
                             f"needed, got {self}")
        if not 0 < self.pause_min_s <= self.pause_median_s <= self.pause_max_s or self.pause_sigma < 0:
            raise ValueError(f"agentic trace: 0 < pause_min_s <= pause_median_s <= pause_max_s and pause_sigma >= 0 "
                             f"needed, got {self}")


def pause(rng: random.Random, spec: AgenticSpec) -> float:
    """One tool pause in seconds: lognormal, clipped to the spec's range."""
    drawn = rng.lognormvariate(math.log(spec.pause_median_s), spec.pause_sigma)
    return min(spec.pause_max_s, max(spec.pause_min_s, drawn))


def _blocks(rng: random.Random, median: float, most: int) -> int:
    return min(most, max(1, round(rng.lognormvariate(math.log(median), 1.0))))


def _geometric(rng: random.Random, mean: float) -> int:
    """A draw from the geometric distribution on 1, 2, ... of mean ``mean`` (1: always 1)."""
    if mean <= 1:
        return 1
    return 1 + math.floor(math.log(1.0 - rng.random()) / math.log(1.0 - 1.0 / mean))


def _session(rng: random.Random, spec: AgenticSpec, name: str, start_s: float, ids: Iterator[int]
             ) -> Iterator[Request]:
    """One session's turns from ``start_s``; each turn's keys extend the previous turn's."""
    turns = max(2, _geometric(rng, spec.turns_mean))
    prompt = [*range(SYSTEM_BLOCKS), *itertools.islice(ids, TASK_BLOCKS)]
    now = start_s
    for turn in range(turns):
        tool = _blocks(rng, 3, 16)
        last = turn == turns - 1 or len(prompt) + OUTPUT_BLOCKS + tool > MAX_PROMPT_BLOCKS
        gap = SERVICE_S + OUTPUT_BLOCKS * BLOCK_TOKENS / DECODE_TOKENS_PER_S + pause(rng, spec)
        at_ms = round(now * 1000)
        # The next turn's arrival as written (milliseconds), so the hint covers it even after rounding.
        gap_s = (round((now + gap) * 1000) - at_ms) / 1000
        yield Request(float(at_ms), len(prompt) * BLOCK_TOKENS, OUTPUT_BLOCKS * BLOCK_TOKENS,
                      tuple(int_key(b) for b in prompt), None, name,
                      None if last else float(math.floor(gap_s) + 1))
        if last:
            return
        prompt = prompt + list(itertools.islice(ids, OUTPUT_BLOCKS + tool))
        now += gap


def _slot(spec: AgenticSpec, slot: int) -> Iterator[Request]:
    """Sessions one after another in one slot until the trace's end."""
    rng = random.Random(f"agentic:{spec.seed}:slot:{slot}")
    ids = itertools.count((slot + 1) << _SPACE_BITS)
    now = rng.uniform(0, 60)
    for number in itertools.count():
        last = None
        for request in _session(rng, spec, f"s{slot}.{number}", now, ids):
            if request.timestamp_ms >= spec.duration_s * 1000:
                return
            last = request
            yield request
        assert last is not None  # a session's first turn is at ``now`` < the end
        now = last.timestamp_ms / 1000 + SERVICE_S + rng.expovariate(1.0 / spec.restart_s)


def _oneoffs(spec: AgenticSpec) -> Iterator[Request]:
    rng = random.Random(f"agentic:{spec.seed}:oneoff")
    ids = itertools.count((spec.sessions + 1) << _SPACE_BITS)
    system = list(range(_ONEOFF_SYSTEM, _ONEOFF_SYSTEM + ONEOFF_SYSTEM_BLOCKS))
    now = 0.0
    while spec.oneoff_per_s > 0:
        now += rng.expovariate(spec.oneoff_per_s)
        if now >= spec.duration_s:
            return
        prompt = system + list(itertools.islice(ids, _blocks(rng, 6, 32)))
        yield Request(float(round(now * 1000)), len(prompt) * BLOCK_TOKENS, BLOCK_TOKENS,
                      tuple(int_key(b) for b in prompt))


def agentic(spec: AgenticSpec) -> Trace:
    """The trace ``spec`` describes, in arrival order (a session turn before a one-off at the same millisecond)."""
    streams = [list(_slot(spec, slot)) for slot in range(spec.sessions)] + [list(_oneoffs(spec))]
    tagged = [(r.timestamp_ms, stream, i, r) for stream, requests in enumerate(streams)
              for i, r in enumerate(requests)]
    tagged.sort(key=lambda t: t[:3])
    return Trace(tuple(t[3] for t in tagged), BLOCK_TOKENS)


def parse_spec(name: str) -> AgenticSpec:
    """The spec an ``agentic[:FIELD=VALUE,...]`` argument names (``agentic:seed=1,oneoff_per_s=1``).

    Raises:
        ValueError: not that form, an unknown field, or a value of the wrong type or range.
    """
    head, _, rest = name.partition(":")
    if head != PREFIX:
        raise ValueError(f"trace {name!r}: expected {PREFIX}[:FIELD=VALUE,...]")
    fields = {f.name: f.type for f in dataclasses.fields(AgenticSpec)}
    values: dict[str, float | int] = {}
    for item in filter(None, rest.split(",")):
        field, sep, text = item.partition("=")
        if not sep or field not in fields:
            raise ValueError(f"trace {name!r}: {item!r} is not FIELD=VALUE with FIELD one of {', '.join(fields)}")
        try:
            values[field] = int(text) if fields[field] == "int" else float(text)
        except ValueError:
            raise ValueError(f"trace {name!r}: {field} needs a number, got {text!r}") from None
    return AgenticSpec(**values)  # type: ignore[arg-type]


def agentic_trace(name: str) -> Trace:
    """The trace an ``agentic[:FIELD=VALUE,...]`` argument names.

    Raises:
        ValueError: as ``parse_spec``.
    """
    return agentic(parse_spec(name))
