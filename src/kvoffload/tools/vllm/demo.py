"""``kvoffload demo``: real vLLM (CPU backend) on a multi-turn chat, without kvoffload and with it.

Data flow: write a real-weight Llama checkpoint (``model.write_tiny_model``) -> build the workload
(``demo_report.user_turns``) -> start two engines in child processes (``demo_engine``: one without, one with
kvoffload) -> send both the same conversations round-robin, turn by turn, request by request, alternating
which engine goes first, so each pair of TTFTs is measured under the same machine load -> the control: the
plain engine serves the last hit turn again with one token changed inside the run kvoffload loaded, which must
move its outputs (``kvoffload.testing.outputs``), or the "outputs match" verdict would prove nothing -> pair the
results (``demo_report.summarize``) -> table, JSON, PNG chart.

The device cache (``num_gpu_blocks_override``) holds about one conversation, so without kvoffload every later
turn recomputes its whole history; with it, the history is loaded from the host tier. Both engines' OpenMP threads
are bound to the same CPUs (``cpu_binding``, ``--cpu-bind``); the summary records what each reported, and engines
bound differently are not compared.

vLLM is imported only in the children: ``kvoffload --help`` imports this module to build its parser.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvoffload.testing.outputs import CONTROL_FACTOR, TOLERANCE, Control, control, with_changed_token
from kvoffload.tools.vllm.cpu_binding import (
    FLAG,
    FLAG_HELP,
    BindingError,
    BindingMismatch,
    CpuBinding,
    EngineBinding,
    resolve,
)
from kvoffload.tools.vllm.demo_engine import EngineSettings, engine_main
from kvoffload.tools.vllm.demo_report import (
    RunResult,
    TurnResult,
    Workload,
    format_report,
    format_turn,
    summarize,
    user_turns,
    write_chart,
)
from kvoffload.tools.vllm.model import ModelFamily, TinyShape, write_tiny_model

Progress = Callable[[str], None]

DEMO_SHAPE = TinyShape(hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=2, head_dim=64,
                       intermediate_size=4 * 512)
"""The demo's model (also ``bench serve``'s): big enough that recomputing a long prompt costs real time on CPU."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's flags: output, workload size, model size, engine knobs."""
    w, m = Workload(), DEMO_SHAPE
    parser.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    parser.add_argument("--out", type=Path, default=Path("out"), help="directory for demo.json and the chart")
    parser.add_argument("--no-chart", action="store_true", help="skip the PNG chart")
    g = parser.add_argument_group("workload")
    g.add_argument("--conversations", type=int, default=w.conversations)
    g.add_argument("--turns", type=int, default=w.turns)
    g.add_argument("--system-tokens", type=int, default=w.system_tokens, help="shared system prompt")
    g.add_argument("--first-user-tokens", type=int, default=w.first_user_tokens, help="opening message")
    g.add_argument("--user-tokens", type=int, default=w.user_tokens, help="each later user message")
    g.add_argument("--reply-tokens", type=int, default=w.reply_tokens, help="generated per turn")
    g.add_argument("--seed", type=int, default=w.seed)
    g = parser.add_argument_group("model (a Llama with seeded random weights, written as a real checkpoint)")
    g.add_argument("--hidden-size", type=int, default=m.hidden_size)
    g.add_argument("--layers", type=int, default=m.num_layers)
    g.add_argument("--heads", type=int, default=m.num_heads)
    g.add_argument("--kv-heads", type=int, default=m.num_kv_heads)
    g.add_argument("--head-dim", type=int, default=m.head_dim)
    g.add_argument("--model-dir", type=Path, default=None, help="where to write the model (default: a temp dir)")
    g = parser.add_argument_group("engine")
    # float32: CPUs without bf16 instructions run bf16 matmuls many times slower.
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument("--block-size", type=int, default=32, help="vLLM block size (a multiple of 32 on CPU)")
    g.add_argument("--device-blocks", type=int, default=None,
                   help="device KV cache size in blocks (default: one conversation and a little)")
    g.add_argument("--host-gib", type=float, default=1.0, help="kvoffload host tier capacity")
    g.add_argument("--remote-url", default=None,
                   help="also a remote tier on this Redis-protocol server (redis://host:port), below the host tier")
    g.add_argument("--remote-server", action="store_true",
                   help="start a throwaway local redis-server (loopback) for the remote tier; needs redis-server")
    g.add_argument("--record-trace", type=Path, default=None, metavar="PATH",
                   help="kvoffload's engine appends each finished request to this JSONL trace (record_trace), for "
                        "kvoffload replay (a line written per request: a little work the plain side does not do)")
    g.add_argument(FLAG, metavar="CPUS", default=None, help=FLAG_HELP)


def run(args: argparse.Namespace) -> int:
    """Run both engines, print the report (or JSON), write out/demo.json and the chart.

    Returns:
        0, 1 when an engine failed (its traceback is printed to stderr) or the engines reported different CPU
        bindings, 2 when ``--cpu-bind`` (or ``VLLM_CPU_OMP_THREADS_BIND``) is not a CPU list this process may use.
    """
    try:
        binding = resolve(args.cpu_bind)
    except BindingError as e:
        _stderr_progress(f"kvoffload demo: {e}")
        return 2
    workload = Workload(conversations=args.conversations, turns=args.turns, system_tokens=args.system_tokens,
                        first_user_tokens=args.first_user_tokens, user_tokens=args.user_tokens,
                        reply_tokens=args.reply_tokens, seed=args.seed)
    progress = _stderr_progress
    with contextlib.ExitStack() as stack:
        model_dir = args.model_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvoffload-")))
        remote_url = args.remote_url
        if args.remote_server and remote_url is None:
            from kvoffload.testing.redis_server import RedisServer

            remote_url = stack.enter_context(RedisServer({"maxmemory": "2gb", "maxmemory-policy": "allkeys-lru"})).url
            progress(f"remote tier: a throwaway redis-server at {remote_url}")
        shape = TinyShape(hidden_size=args.hidden_size, num_layers=args.layers, num_heads=args.heads,
                          num_kv_heads=args.kv_heads, head_dim=args.head_dim, intermediate_size=4 * args.hidden_size)
        write_tiny_model(model_dir, ModelFamily.LLAMA, shape, seed=args.seed)
        settings = [EngineSettings(model_dir, workload, with_kvoffload, args.dtype, args.block_size,
                                   args.device_blocks, args.host_gib, remote_url, binding=binding,
                                   record_trace=args.record_trace if with_kvoffload else None)
                    for with_kvoffload in (False, True)]
        try:
            off, on, check = serve_both(settings, progress)
            summary = summarize(off, on, check, extra=_settings(workload, args, binding))
        except (EngineError, BindingMismatch) as e:
            progress(f"kvoffload demo: {e}")
            return 1
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "demo.json").write_text(json.dumps(summary, indent=2) + "\n")
    if not args.no_chart:
        chart = args.out / "demo_ttft.png"
        summary["chart"] = str(chart) if write_chart(summary, chart) else None
        if summary["chart"] is None:
            progress("matplotlib is not installed: no chart (pip install matplotlib)")
    if args.json:
        print(json.dumps({k: v for k, v in summary.items() if k != "turns"}, indent=2))
    else:
        print(format_report(summary))
        print(f"details: {args.out / 'demo.json'}" + (f", chart: {summary['chart']}" if summary.get("chart") else ""))
    return 0


class EngineError(RuntimeError):
    """A demo engine (child process) failed; the message carries its traceback."""


class _Engine:
    """The parent's handle on one child engine (``demo_engine.engine_main``)."""

    def __init__(self, ctx: Any, settings: EngineSettings) -> None:
        self.name = settings.name
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=engine_main, args=(child, settings), name=f"kvoffload-demo-{self.name}")
        self.process.start()
        child.close()
        self.busy_s = 0.0
        self.binding: EngineBinding | None = None

    def _recv(self) -> Any:
        try:
            kind, value = self.conn.recv()
        except EOFError:
            raise EngineError(f"the {self.name} engine exited (code {self.process.exitcode})") from None
        if kind == "error":
            raise EngineError(f"the {self.name} engine failed:\n{value}")
        return value

    def wait_ready(self) -> None:
        self.binding = self._recv()

    def serve(self, conv: int, turn: int, prompt: list[int]) -> TurnResult:
        start = time.perf_counter()
        self.conn.send((conv, turn, prompt))
        result: TurnResult = self._recv()
        self.busy_s += time.perf_counter() - start
        return result

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def serve_both(settings: list[EngineSettings], progress: Progress
               ) -> tuple[RunResult, RunResult, Control | None]:
    """Serve the workload on both engines, request by request, alternating which engine goes first, then run
    the control on the plain engine (None when no turn loaded anything).

    Conversations are served round-robin, turn by turn; each engine keeps its own histories (its own replies).
    """
    progress("starting two vLLM engines (without and with kvoffload) in child processes")
    (off, on), controls = serve_engines(settings, progress)
    return off, on, controls["on"]


def serve_engines(settings: list[EngineSettings], progress: Progress,
                  on_start: Callable[[int], None] | None = None, on_ready: Callable[[], None] | None = None
                  ) -> tuple[list[RunResult], dict[str, Control | None]]:
    """``serve_both`` for any number of engines, the plain one first in ``settings``: each request goes to every
    engine in turn, the order reversed every request; then a control on the plain engine for each other engine
    (keyed by its name; None when it loaded nothing). ``on_start`` gets each child's pid as it starts,
    ``on_ready`` is called once every engine is warm, before the first request."""
    workload = settings[0].workload
    ctx = multiprocessing.get_context("spawn")
    engines: list[_Engine] = []
    try:
        for s in settings:
            engines.append(_Engine(ctx, s))
            if on_start is not None and engines[-1].process.pid is not None:
                on_start(engines[-1].process.pid)
        for engine in engines:
            engine.wait_ready()
        if on_ready is not None:
            on_ready()
        messages = user_turns(workload, _vocab_size(settings[0].model_dir))
        histories: dict[str, list[list[int]]] = {e.name: [[] for _ in messages] for e in engines}
        results: dict[str, list[TurnResult]] = {e.name: [] for e in engines}
        plain_prompts: list[list[int]] = []
        for i, (conv, turn) in enumerate(_schedule(workload)):
            for engine in engines if i % 2 == 0 else engines[::-1]:
                history = histories[engine.name][conv]
                history += messages[conv][turn]
                if engine is engines[0]:
                    plain_prompts.append(list(history))
                result = engine.serve(conv, turn, history)
                history += result.tokens
                results[engine.name].append(result)
                progress(format_turn(engine.name, result))
        checks = {e.name: run_control(engines[0], results, plain_prompts, _vocab_size(settings[0].model_dir),
                                      progress, side=e.name) for e in engines[1:]}
    finally:
        for engine in engines:
            engine.stop()
    return [RunResult(e.name, tuple(results[e.name]), e.busy_s, e.binding) for e in engines], checks


def run_control(plain: _Engine, results: dict[str, list[TurnResult]], plain_prompts: list[list[int]],
                vocab_size: int, progress: Progress, side: str = "on") -> Control | None:
    """Serve the last hit turn's prompt on the plain engine with one token changed inside the run the ``side``
    engine (kvoffload) loaded for it: the outputs must move, or comparing the two engines' outputs proves nothing."""
    hits = [(i, p) for i, t in enumerate(results[side]) if (p := t.loaded_position()) is not None]
    if not hits:
        return None
    i, position = hits[-1]
    original = results["off"][i]
    changed = plain.serve(original.conversation, original.turn,
                          with_changed_token(plain_prompts[i], position, vocab_size))
    outcome = control([original], [changed])
    progress(f"control: prompt token {position} of conv {original.conversation} turn {original.turn} changed; "
             f"plain vLLM's outputs moved by {outcome.shift:.3f} (needs {CONTROL_FACTOR * TOLERANCE}): "
             f"{'holds' if outcome.holds else 'FAILED'}")
    return outcome


def _schedule(workload: Workload) -> list[tuple[int, int]]:
    """(conversation, turn) in serving order: every conversation's turn 0, then every turn 1, ..."""
    return [(conv, turn) for turn in range(workload.turns) for conv in range(workload.conversations)]


def _vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def _settings(workload: Workload, args: argparse.Namespace, binding: CpuBinding) -> dict[str, Any]:
    return {
        "cpu_binding": binding.as_json(),
        "workload": {k: v for k, v in vars(workload).items()},
        "model": {"hidden_size": args.hidden_size, "layers": args.layers, "heads": args.heads,
                  "kv_heads": args.kv_heads, "head_dim": args.head_dim, "dtype": args.dtype},
        "engine": {"block_size": args.block_size, "device_blocks": args.device_blocks, "host_gib": args.host_gib,
                   "remote_tier": bool(args.remote_url or args.remote_server)},
    }


def _stderr_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
