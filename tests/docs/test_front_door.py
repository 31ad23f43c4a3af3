"""The README is a front door, short enough to read through, and the documentation quotes no
commit and no count of a test run: such figures describe one checkout on one day, not the product,
and go stale with the next commit."""

from __future__ import annotations

import re

from tests.docs.docs_build import REPO

README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
README_MOST_LINES = 250
# 7 to 40 hexadecimal digits standing alone, with at least one digit and one letter: a commit's
# (abbreviated) hash. Words of letters a-f alone ("decade") and numbers alone ("2628480") are not.
COMMIT = re.compile(r"(?<![\w/.#-])(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w/-])")
# What pytest (or a person quoting it) prints of a run: "1384 passed", "5 skipped", "29 tests".
RUN_COUNT = re.compile(r"\b\d+ (passed|failed|skipped|errors?|deselected|xfailed|xpassed|tests)\b")
DOC_LINK = re.compile(r"\]\((docs/[\w./-]+\.(?:md|png))(#[\w-]+)?\)")


def _lines_matching(pattern: re.Pattern[str]) -> list[str]:
    return [
        f"{path.relative_to(REPO)}:{number}: {match.group(0)!r} in {line.strip()[:120]}"
        for path in PAGES
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        for match in pattern.finditer(line)
    ]


def test_the_readme_is_at_most_250_lines() -> None:
    count = len(README.read_text(encoding="utf-8").splitlines())
    assert count <= README_MOST_LINES, f"expected README.md within {README_MOST_LINES} lines, got {count}"


def test_no_commit_hash_in_the_readme_or_the_docs() -> None:
    found = _lines_matching(COMMIT)
    assert found == [], "expected no commit hash in README.md or docs/, got:\n" + "\n".join(found)


def test_no_test_run_count_in_the_readme_or_the_docs() -> None:
    found = _lines_matching(RUN_COUNT)
    assert found == [], "expected no test-run count in README.md or docs/, got:\n" + "\n".join(found)


def test_the_patterns_catch_what_they_are_for() -> None:
    # The two patterns above pass vacuously if they match nothing: they must match the real thing.
    assert COMMIT.search("green at 258bdf5, 26 min") and COMMIT.search("checkout f5ffe6a;"), "expected hashes found"
    assert not COMMIT.search("2628480 elements, a decade, fp16, 0x7fff"), "expected no hash in plain words"
    assert RUN_COUNT.search("1235 passed, 5 skipped") and RUN_COUNT.search("(29 tests, about"), "expected counts"


def test_the_readme_links_to_pages_and_pictures_that_exist() -> None:
    # MkDocs checks links between the pages; the README is outside docs/, so its links are checked here.
    text = README.read_text(encoding="utf-8")
    links = DOC_LINK.findall(text)
    missing = [target for target, _ in links if not (REPO / target).is_file()]
    assert links and missing == [], f"expected every docs/ file the README links to, got missing {missing}"
