"""The dashboard: its JSON names only series that exist, and ``bench serve --dashboard`` draws them from samples."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvoffload.tools.bench.serve_dashboard import Sampler, draw, rates, total

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "docs" / "grafana" / "kvoffload.json"
# vLLM's own series the dashboard shows beside ours (vllm/v1/metrics/loggers.py in vLLM 0.32).
VLLM_SERIES = {"vllm:prefix_cache_hits_total", "vllm:num_requests_running", "vllm:time_to_first_token_seconds_bucket"}
HITS = 'vllm:kvoffload_hit_tokens_total{engine="0"}'
H2D = 'vllm:kvoffload_transfer_bytes_total{direction="host_to_device",engine="0"}'


def test_the_dashboard_names_only_series_a_server_exposes() -> None:
    from tests.integrations.test_metrics import _registered  # what a fresh server lists

    exposed = set(re.findall(r"^(vllm:[a-z_]+)", _registered({"disk_path": "/tmp", "disk_bytes": 1 << 30}), re.M))
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    used = {name for e in exprs for name in re.findall(r"vllm:[a-z_]+", e)}
    assert used - VLLM_SERIES <= exposed, used - VLLM_SERIES - exposed
    assert "vllm:kvoffload_tier_used_bytes" not in exposed  # the check can fail: a made-up name is not exposed


def test_rates_are_counter_differences_over_time() -> None:
    samples = [(10.0, {HITS: 0.0, H2D: 0.0}), (12.0, {HITS: 64.0, H2D: 4096.0}), (13.0, {HITS: 64.0, H2D: 4096.0})]
    assert rates(samples, "vllm:kvoffload_hit_tokens_total") == ([2.0, 3.0], [32.0, 0.0])
    assert rates(samples, "vllm:kvoffload_transfer_bytes_total", 'direction="host_to_device"')[1] == [2048.0, 0.0]
    assert rates(samples, "vllm:kvoffload_transfer_bytes_total", 'direction="disk_to_host"')[1] == [0.0, 0.0]
    assert total(samples[1][1], "vllm:kvoffload_hit_tokens") == 0  # whole names only


def test_a_sampler_scrapes_until_stopped_and_the_panels_are_drawn(tmp_path: Path) -> None:
    count = iter(range(1000))

    def scrape() -> dict[str, float]:
        n = float(next(count))
        return {HITS: 16 * n, H2D: 1024 * n, 'vllm:kvoffload_host_used_bytes{engine="0"}': 4096 * n}

    sampler = Sampler(scrape, period_s=0.01)
    sampler.start()
    while len(sampler.samples) < 3:
        sampler._stop.wait(0.01)
    sampler.stop()
    n = len(sampler.samples)
    assert n >= 4 and [s[HITS] for _, s in sampler.samples] == [16.0 * i for i in range(n)]
    draw(str(tmp_path / "panels.png"), sampler.samples)
    assert (tmp_path / "panels.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
