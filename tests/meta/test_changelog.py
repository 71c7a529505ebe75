"""CHANGELOG.md stays in Keep a Changelog form, and the version lives in one place (``__version__``)."""

from __future__ import annotations

import re
from pathlib import Path

import lightning_mgpu

ROOT = Path(__file__).resolve().parents[2]
TYPES = ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security")  # keepachangelog.com 1.1.0
RELEASE = re.compile(r"^## \[(Unreleased|\d+\.\d+\.\d+)\](?: - (\d{4}-\d{2}-\d{2}))?$")


def sections() -> list[tuple[str, list[str]]]:
    releases: list[tuple[str, list[str]]] = []
    for line in (ROOT / "CHANGELOG.md").read_text().splitlines():
        if line.startswith("## "):
            releases.append((line, []))
        elif line.startswith("### "):
            assert releases, f"{line!r} before any release heading"
            releases[-1][1].append(line[4:])
    return releases


def test_every_release_heading_is_unreleased_or_a_dated_version_newest_first():
    headings = [RELEASE.match(h) for h, _ in sections()]
    assert all(headings), [h for h, _ in sections()]
    assert headings[0] is not None and headings[0].group(1) == "Unreleased"  # always there, on top
    versions = [tuple(map(int, m.group(1).split("."))) for m in headings[1:] if m is not None]
    assert all(m is not None and m.group(2) for m in headings[1:])  # a release has a date
    assert versions == sorted(versions, reverse=True)


def test_each_release_groups_changes_under_each_type_once():
    for heading, types in sections():
        assert set(types) <= set(TYPES), (heading, types)
        assert len(types) == len(set(types)), f"{heading}: a change type appears twice: {types}"


def test_the_version_is_declared_once_and_matches_the_changelog():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and 'attr = "lightning_mgpu.__version__"' in pyproject
    releases = [RELEASE.match(h).group(1) for h, _ in sections()[1:]]  # type: ignore[union-attr]
    version = lightning_mgpu.__version__
    if ".dev" in version:  # a development version is newer than every release listed
        assert all(
            tuple(map(int, r.split("."))) < tuple(map(int, version.split(".dev")[0].split("."))) for r in releases
        )
    else:
        assert releases and releases[0] == version, "a release version needs its dated CHANGELOG section"
