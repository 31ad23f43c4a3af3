"""The documentation builds in strict mode, and a broken reference fails the build.

The first test is what ``make docs`` runs; the others plant a fault in a copy of the docs and show
that strict mode turns it into a failed build naming it, so that a green build means something.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.docs_build import REPO, build, copy_docs


def test_the_documentation_builds_in_strict_mode(tmp_path: Path) -> None:
    result = build(REPO, tmp_path / "site")
    assert result.returncode == 0, (
        f"expected `mkdocs build --strict` to succeed, got exit code {result.returncode}:\n{result.stderr}"
    )
    pages = sorted(p.name for p in (tmp_path / "site").glob("*.html"))
    assert "benchmarks.html" in pages and "fsdp2-api.html" in pages, f"expected the reference pages, got {pages}"


@pytest.mark.parametrize(
    ("link", "named"),
    [
        ("[a page that is not there](no-such-page.md)", "no-such-page.md"),
        ("[a section that is not there](benchmarks.md#no-such-section)", "#no-such-section"),
    ],
    ids=["missing-page", "missing-anchor"],
)
def test_a_broken_link_fails_the_build(tmp_path: Path, link: str, named: str) -> None:
    root = copy_docs(tmp_path)
    page = root / "docs" / "index.md"
    page.write_text(page.read_text(encoding="utf-8") + f"\nSee {link}.\n", encoding="utf-8")
    result = build(root, tmp_path / "site")
    output = result.stdout + result.stderr
    assert result.returncode != 0, f"expected the build to fail on {link}, got exit code 0:\n{output}"
    assert named in output and "index.md" in output, (
        f"expected the build's output to name {named!r} in index.md, got:\n{output}"
    )


def test_a_results_table_of_a_missing_file_fails_the_build(tmp_path: Path) -> None:
    root = copy_docs(tmp_path)
    page = root / "docs" / "benchmarks.md"
    page.write_text(
        page.read_text(encoding="utf-8") + "\n<!-- results-table: no-such-results.json -->\n", encoding="utf-8"
    )
    result = build(root, tmp_path / "site")
    output = result.stdout + result.stderr
    assert result.returncode != 0, f"expected the build to fail on a missing results file, got exit code 0:\n{output}"
    assert "benchmarks/results/no-such-results.json" in output and "benchmarks.md" in output, (
        f"expected the output to name the missing file and the page asking for it, got:\n{output}"
    )
