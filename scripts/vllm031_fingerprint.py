"""Whether the code that differs between vLLM versions changed since the full vLLM 0.31 e2e set last passed.

``make test`` runs every test on vLLM 0.32 but, on vLLM 0.31, only the adapter tests and an e2e smoke (in-process,
multiprocess, speculative, tensor parallel): the rest of the 0.31 e2e set takes ten minutes and proves the same
kvoffload code again. It must run again when what can differ between versions changes: the adapter
(``src/kvoffload/integrations/vllm/``), the e2e tests themselves, or the vLLM pins. This script hashes those files
(their paths and contents, in sorted order) into one fingerprint; ``make test-vllm031-full`` records it in
``FINGERPRINT_FILE`` once the full set passed (commit that file with the change), and ``make test`` runs the full
set instead of the smoke whenever the tree's fingerprint differs from the one recorded, CI included.

Standard library only: it runs from the Makefile with the system Python.

Usage: ``python3 scripts/vllm031_fingerprint.py check`` (exit 0: recorded and unchanged; 1: run the full set) or
``... record`` (write the tree's fingerprint).
"""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FINGERPRINT_FILE = ROOT / ".ci" / "vllm031-full.sha256"
WATCHED = ("src/kvoffload/integrations/vllm", "tests/e2e", "requirements-vllm031.txt", "requirements-vllm.txt",
           "requirements-vllm033.txt", "requirements-vllm034.txt")
"""What can behave differently on another vLLM version: files, or folders whose ``*.py`` files are all watched."""


def watched_files(root: Path = ROOT) -> list[Path]:
    files: list[Path] = []
    for name in WATCHED:
        path = root / name
        files.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return files


def fingerprint(files: Iterable[Path], root: Path = ROOT) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() if path.exists() else b"<missing>")
        digest.update(b"\0")
    return digest.hexdigest()


def recorded(path: Path = FINGERPRINT_FILE) -> str | None:
    try:
        return path.read_text(encoding="utf-8").split()[0]
    except (OSError, IndexError):
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("check", "record"))
    args = parser.parse_args()
    now = fingerprint(watched_files())
    if args.command == "record":
        note = f"full vLLM 0.31 e2e set passed on this tree (scripts/{Path(__file__).name})"
        FINGERPRINT_FILE.write_text(f"{now}  {note}\n", encoding="utf-8")
        print(f"recorded {now[:12]} in {FINGERPRINT_FILE.relative_to(ROOT)}")
        return 0
    if recorded() == now:
        print(f"vLLM 0.31: the version-dependent code is as when the full e2e set last passed ({now[:12]}): smoke")
        return 0
    print(f"vLLM 0.31: the version-dependent code changed since the full e2e set last passed ({now[:12]}, "
          f"recorded {str(recorded())[:12]}): the full set runs")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
