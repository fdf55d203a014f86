"""The docs hold together: every relative link in README.md and docs/ names a file that exists, and
every anchor into a markdown file names one of its headings (GitHub's slugs); no page grows past
what one reads in a sitting."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MAX_PAGE_LINES = 420
# Reference pages read by section rather than end to end, so they may run longer than a task's page
LONG_PAGES_ALLOWED = {"docs/PERFORMANCE.md", "docs/PROTOCOL.md"}

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1", re.M | re.S)
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.M)


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def without_code_blocks(text: str) -> str:
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link markup reduced to its text, lowercased, punctuation
    (backticks included) dropped except '-' and '_', each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for match in HEADING.finditer(without_code_blocks(path.read_text())):
        base = slug(match.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")  # GitHub numbers repeated headings
    return found


def relative_links(path: Path) -> list[str]:
    links = LINK.findall(without_code_blocks(path.read_text()))
    return [link for link in links if not re.match(r"(https?|mailto):", link, re.I)]


def test_the_slugs_follow_githubs_rules():
    assert slug("Continuous batching and prefill") == "continuous-batching-and-prefill"
    assert slug("`max_wait_ms` and `max_batch_size`") == "max_wait_ms-and-max_batch_size"
    assert slug("Kubernetes, autoscaled on queue lag") == "kubernetes-autoscaled-on-queue-lag"
    assert slug("Attention in C++ (`kernels/csrc/`)") == "attention-in-c-kernelscsrc"


@pytest.mark.parametrize("page", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for link in relative_links(page):
        target, _, anchor = link.partition("#")
        file = (page.parent / target).resolve() if target else page
        if not file.exists():
            broken.append(f"{link}: no {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
        elif anchor and file.suffix == ".md" and anchor.lower() not in anchors(file):
            broken.append(f"{link}: no heading in {file.relative_to(ROOT)} gives #{anchor}")
    assert not broken, broken


def test_no_page_under_docs_outgrows_a_sitting():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in DOCS.rglob("*.md")}
    long = {page: n for page, n in sizes.items() if n > MAX_PAGE_LINES and page not in LONG_PAGES_ALLOWED}
    assert not long, long


def test_the_docs_screenshots_of_the_dashboard_show_the_current_page():
    """The dashboard's screenshots in docs/images are made by its browser tests
    (tests/gateway/test_dashboard_page.py); they name the page version they show, which must be the
    current one: a change to the page's files asks for new screenshots."""
    from tokenfleet.gateway.dashboard.routes import assets_digest

    shown = (DOCS / "images" / "dashboard-version.txt").read_text().strip()
    assert shown == assets_digest(), (
        "the page changed since its screenshots were made: run "
        "TOKENFLEET_SCREENSHOTS=docs/images pytest -n 0 tests/gateway/test_dashboard_page.py"
    )
    for name in ("overview", "request", "dead-letters", "queue"):
        assert (DOCS / "images" / f"dashboard-{name}.png").stat().st_size > 10_000
