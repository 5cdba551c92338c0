"""bench.common: summaries, machine facts, table, progress, JSON report."""

from __future__ import annotations

import argparse
import io
import json

import pytest

from kvoffload.tools.bench.common import (
    Progress,
    Report,
    add_common_arguments,
    emit,
    format_table,
    machine_facts,
    summarize,
)


def test_summarize_gives_median_extremes_and_quartiles() -> None:
    m = summarize([5.0, 1.0, 3.0, 2.0, 4.0], "ops/s")
    assert (m.median, m.min, m.max, m.q1, m.q3, m.runs) == (3.0, 1.0, 5.0, 2.0, 4.0, 5)
    assert m.spread == pytest.approx(4.0 / 3.0)


def test_summarize_of_one_sample_has_no_spread() -> None:
    m = summarize([2.0], "us")
    assert (m.median, m.q1, m.q3, m.spread) == (2.0, 2.0, 2.0, 0.0)


def test_summarize_refuses_no_samples() -> None:
    with pytest.raises(ValueError, match="no samples"):
        summarize([], "us")


def test_machine_facts_name_cpu_cores_and_versions() -> None:
    facts = machine_facts()
    assert set(facts) == {"cpu", "cores", "os", "python", "torch", "vllm"}
    assert int(facts["cores"]) >= 1
    assert facts["python"].count(".") == 2


def test_table_aligns_numbers_right_and_text_left() -> None:
    text = format_table(("name", "value"), [("a", 1.5), ("longer", 12345.0)])
    lines = text.splitlines()
    assert lines[0].startswith("name")
    assert lines[2] == "a".ljust(6) + "  " + "1.5".rjust(6)
    assert lines[3] == "longer  12,345"


def test_progress_writes_to_its_stream_and_clears_it() -> None:
    stream = io.StringIO()
    progress = Progress("bench", 2, stream=stream)
    progress.advance("x")
    progress.close()
    assert "bench 1/2 x" in stream.getvalue()
    assert stream.getvalue().endswith("\r")


def test_silent_progress_writes_nothing() -> None:
    stream = io.StringIO()
    progress = Progress("bench", 2, enabled=False, stream=stream)
    progress.advance()
    progress.close()
    assert stream.getvalue() == ""


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_common_arguments(parser)
    return parser.parse_args(argv)


def test_json_report_parses_with_machine_and_measurements() -> None:
    report = Report("x", [{"op": "a", "ours": summarize([1.0, 3.0], "us")}], "table", ("note",), {"runs": 2})
    out = io.StringIO()
    emit(report, _args("--json"), out)
    doc = json.loads(out.getvalue())
    assert doc["bench"] == "x" and doc["settings"] == {"runs": 2} and doc["notes"] == ["note"]
    assert doc["rows"][0]["ours"]["median"] == 2.0 and doc["rows"][0]["ours"]["spread"] == 1.0
    assert "cpu" in doc["machine"]


def test_text_report_has_facts_table_and_notes_and_draws_the_plot() -> None:
    drawn: list[str] = []
    out = io.StringIO()
    emit(Report("x", [], "TABLE", ("a note",)), _args("--plot", "p.png"), out, plot=drawn.append)
    text = out.getvalue()
    assert text.startswith("kvoffload bench x: cpu ") and "TABLE" in text and "  a note" in text
    assert drawn == ["p.png"]


def test_a_plot_that_cannot_be_drawn_is_reported_not_raised(capsys: pytest.CaptureFixture[str]) -> None:
    def no_matplotlib(path: str) -> None:
        raise ModuleNotFoundError("No module named 'matplotlib'")

    emit(Report("x", [], "TABLE"), _args("--plot", "p.png"), io.StringIO(), plot=no_matplotlib)
    assert "no plot written" in capsys.readouterr().err
