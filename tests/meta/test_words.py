"""The project's text speaks about the pack to its users, not about how it was written.

Articles and papers are named by title or topic ("the mixed-precision article's recipe", "the ZeRO paper"), never by
a reference number ("seed 003"); nothing speaks of who or what wrote it or of which machines were lent to whom
("no GPU was lent"): a figure that could not be measured says "not measured on a GPU yet" and how to measure it.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ["lightning_mgpu", "docs", "README.md", "CHANGELOG.md", "notebooks", "benchmarks", "tests", "configs"]
SUFFIXES = {".py", ".md", ".ipynb", ".yaml", ".yml", ".txt", ".rst", ".toml", ".cfg"}
SKIPPED_DIRS = {"_build", "_generated", "generated", "__pycache__", ".ipynb_checkpoints"}

FORBIDDEN = [
    re.compile(r"seeds?[ _#-]?0\d\d", re.I),  # "seed 003", "seed_003", "seeds 001"
    re.compile(r"\bseed's\b", re.I),
    re.compile(r"no GPU (was |were )?lent", re.I),
    re.compile(r"\b(was|were|been|is|are) lent\b", re.I),
    re.compile(r"\bGPUs? lent\b", re.I),
    re.compile(r"\bsessions? (that|which|who) wrote\b", re.I),
    re.compile(r"\bwritten by (an? |the )?(AI|agent|assistant|LLM|model|session)s?\b", re.I),
]

# Hits in lightning_mgpu/, which is maintained elsewhere: each entry is (path, the exact offending line, stripped).
# This list is to be emptied by fixing those lines; nothing outside lightning_mgpu/ may be added to it.
ALLOWED_PENDING_FIX: set[tuple[str, str]] = set()


def scanned_files() -> list[Path]:
    files = []
    for name in SCANNED:
        path = ROOT / name
        if path.is_file():
            files.append(path)
            continue
        for f in sorted(path.rglob("*")):
            if f.is_file() and f.suffix in SUFFIXES and not SKIPPED_DIRS.intersection(f.relative_to(ROOT).parts):
                files.append(f)
    return [f for f in files if f != Path(__file__).resolve()]


def hits() -> list[tuple[str, int, str]]:
    found = []
    for f in scanned_files():
        for number, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            if any(p.search(line) for p in FORBIDDEN):
                found.append((str(f.relative_to(ROOT)), number, line.strip()))
    return found


def test_no_reference_numbers_or_words_about_the_writing() -> None:
    unexpected = [f"{path}:{n}: {line}" for path, n, line in hits() if (path, line) not in ALLOWED_PENDING_FIX]
    assert unexpected == [], "name articles by title or topic; say 'not measured on a GPU yet':\n" + "\n".join(
        unexpected
    )


def test_the_allow_list_holds_only_pending_hits_in_the_package() -> None:
    assert all(path.startswith("lightning_mgpu/") for path, _ in ALLOWED_PENDING_FIX)
    current = {(path, line) for path, _, line in hits()}
    fixed = ALLOWED_PENDING_FIX - current
    assert fixed == set(), f"fixed since: remove from ALLOWED_PENDING_FIX: {sorted(fixed)}"


def test_the_patterns_catch_what_they_are_for() -> None:
    bad = ["as in seed 003", "seed_003", "the seed's recipe", "(no GPU lent)", "no GPU was lent"]
    bad += ["the sessions that wrote", "GPUs were lent"]
    good = ["seed_everything(42)", "the mixed-precision article's recipe", "not measured on a GPU yet", "measured here"]
    assert all(any(p.search(s) for p in FORBIDDEN) for s in bad)
    assert not any(p.search(s) for p in FORBIDDEN for s in good)
