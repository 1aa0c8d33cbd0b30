"""Every committed report and the overview, read as a browser would get them: no headless browser
installs on the CI machine, so the HTML is parsed for what a reader would see wrong."""

from html.parser import HTMLParser
from pathlib import Path

import pytest

from bench.report.page import STYLE

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(ROOT.glob("results/*/report.html")) + [ROOT / "results/overview/overview.html"]


class Page(HTMLParser):
    """The page's visible text, its headings in order, and where the headline box and the first
    device are."""

    def __init__(self) -> None:
        super().__init__()
        self.text: list[str] = []
        self.order: list[str] = []  # "headline", and each h2's text
        self.images = 0
        self._h2 = False

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag == "div" and ("class", "headline") in attrs:
            self.order.append("headline")
        self._h2 = tag == "h2"
        self.images += tag == "img"

    def handle_data(self, data: str) -> None:
        self.text.append(data)
        if self._h2:
            self.order.append(data)
            self._h2 = False


def read(path: Path) -> Page:
    page = Page()
    page.feed(path.read_text())
    return page


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.parent.name)
def test_no_literal_markdown_reaches_the_reader(path):
    text = "".join(read(path).text)
    assert "**" not in text and "](" not in text, f"{path}: Markdown shown as text"


@pytest.mark.parametrize(
    "path", [p for p in PAGES if p.name == "report.html"], ids=lambda p: p.parent.name
)
def test_every_report_opens_with_what_to_use_before_any_device_section(path):
    order = read(path).order
    assert order[:2] == ["What to use", "headline"], f"{path}: the first screen is {order[:3]}"


def test_images_never_overflow_their_box_and_wide_tables_scroll_in_their_own():
    assert "img{max-width:100%}" in STYLE and ".scroll{overflow-x:auto}" in STYLE
    # a table wider than the screen (bert-varlen's at 1366×768) scrolls under its run names, which
    # stay in view
    assert ".scroll td:first-child{position:sticky;left:0" in STYLE
    assert all(read(p).images for p in PAGES)  # the plots are there, embedded
