"""The docs stay true to the code."""

from pathlib import Path

from kvoffload.config import KEYS

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_doc_lists_every_key():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    missing = [key for key in KEYS if f"`{key}`" not in doc]
    assert missing == []


def test_readme_starts_with_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    quick = readme[readme.index("## Quick start"):]
    assert quick.index("make demo") < quick.index("make test")
