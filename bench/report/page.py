"""A report as a list of blocks, written out twice: Markdown for the repository, and a
self-contained HTML page (styles inline, images embedded as data URIs) that opens from disk and can
be mailed around."""

from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from bench.report.tables import to_markdown


@dataclass(frozen=True)
class Block:
    kind: str  # h1 | h2 | h3 | p | table | list | image | nav | headline
    # text, a DataFrame, a list of strings, an image Path; nav: (label, page path without suffix)
    # pairs; headline: (heading line, its items) pairs, shown boxed as a page's first answer
    content: object


def markdown(blocks: list[Block], root: Path) -> str:
    out = []
    for b in blocks:
        if b.kind in ("h1", "h2", "h3"):
            out.append("#" * int(b.kind[1]) + f" {b.content}")
        elif b.kind == "p":
            out.append(str(b.content))
        elif b.kind == "table":
            out.append(to_markdown(b.content))
        elif b.kind == "list":
            out.append("\n".join(f"- {item}" for item in b.content))
        elif b.kind == "image":
            out.append(f"![{b.content.stem}]({b.content.relative_to(root).as_posix()})")
        elif b.kind == "nav":  # the Markdown pages link to each other
            out.append(" · ".join(f"[{label}]({page}.md)" for label, page in b.content))
        elif b.kind == "headline":
            out.append(
                "\n\n".join(
                    f"**{line}**\n\n" + "\n".join(f"- {i}" for i in items)
                    for line, items in b.content
                )
            )
        out.append("")
    return "\n".join(out)


# Text cells read left to right, figures line up on the right; a wide table scrolls in its own box,
# so a narrow window never loses the page's right edge.
STYLE = (
    "body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;"
    "color:#222}\n"
    ".scroll{overflow-x:auto}table{border-collapse:collapse;font-size:13px;margin:1em 0}\n"
    "th,td{border:1px solid #ccc;padding:3px 6px;text-align:left;vertical-align:top}"
    "th{background:#f2f2f2}\n"
    "td.n{text-align:right;white-space:nowrap}img{max-width:100%}"
    "code{background:#f4f4f4;padding:0 3px}\n"
    "nav{margin:0.5em 0 1em}"
    ".headline{background:#f6f8fa;border:1px solid #d0d7de;padding:0.2em 1em;margin:1em 0}\n"
    ".scroll td:first-child{position:sticky;left:0;background:#fff}\n"
    ".scroll th:first-child{position:sticky;left:0}"
)
NUMBER = re.compile(r"<td>([-+−]?[\d.,]+(?:e[-+]?\d+)?[×%]?|–)</td>")


def html_page(blocks: list[Block], title: str) -> str:
    out = [
        "<!DOCTYPE html><html><head><meta "
        f"charset='utf-8'><title>{html.escape(title)}</title><style>{STYLE}</style></head><body>"
    ]
    for b in blocks:
        if b.kind in ("h1", "h2", "h3"):
            out.append(f"<{b.kind}>{html.escape(str(b.content))}</{b.kind}>")
        elif b.kind == "p":
            out.append(f"<p>{_inline(str(b.content))}</p>")
        elif b.kind == "table":
            df: pd.DataFrame = b.content
            table = df.astype(object).where(df.notna(), "–").to_html(index=False, border=0)
            out.append(
                "<div class='scroll'>" + NUMBER.sub(r'<td class="n">\1</td>', table) + "</div>"
            )
        elif b.kind == "list":
            out.append("<ul>" + "".join(f"<li>{_inline(str(i))}</li>" for i in b.content) + "</ul>")
        elif b.kind == "image":
            data = base64.b64encode(Path(b.content).read_bytes()).decode()
            out.append(
                f"<p><img alt='{html.escape(b.content.stem)}' "
                f"src='data:image/png;base64,{data}'></p>"
            )
        elif b.kind == "nav":  # the HTML pages link to each other
            out.append(
                "<nav>"
                + " · ".join(
                    f"<a href='{html.escape(page)}.html'>{html.escape(label)}</a>"
                    for label, page in b.content
                )
                + "</nav>"
            )
        elif b.kind == "headline":
            out.append(f"<div class='headline'>{_headline_html(b.content)}</div>")
    return "\n".join(out) + "\n</body></html>\n"


def _link(match: re.Match[str]) -> str:
    label, target = match.groups()
    if re.match(r"https?://", target, re.IGNORECASE) or (
        ":" not in target and not target.startswith("//")
    ):
        return f"<a href='{target}'>{label}</a>"
    return match.group(0)


def _headline_html(groups: list[tuple[str, list[str]]]) -> str:
    return "".join(
        f"<p><b>{_inline(line)}</b></p><ul>"
        + "".join(f"<li>{_inline(i)}</li>" for i in items)
        + "</ul>"
        for line, items in groups
    )


def _inline(text: str) -> str:
    """Escaped text with Markdown's `code`, **bold** and [links](target) kept: a link only to a
    relative path or http(s); any other target (javascript:, data:, a run named to look like a link)
    stays text."""
    text = re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", _link, html.escape(text))
    parts = text.split("`")
    text = "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))
    parts = text.split("**")
    return "".join(f"<b>{p}</b>" if i % 2 else p for i, p in enumerate(parts))
