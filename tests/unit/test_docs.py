"""README.md and docs/: every relative link leads to a file that exists, and every anchor to a heading in it."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import REPO

FENCE = re.compile(r"^(`{3,}|~{3,}).*?^\1[ \t]*$", flags=re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", flags=re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
IMG = re.compile(r"<img\b[^>]*\bsrc=\"([^\"]+)\"", flags=re.I)
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.+?)[ \t#]*$", flags=re.M)


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _prose(text: str) -> str:
    """The text a reader sees as Markdown: fenced blocks and code spans taken out (a link there is not a link)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def anchors(text: str) -> set[str]:
    """GitHub's heading ids: lower case, formatting and punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for _, title in HEADING.findall(FENCE.sub("", text)):
        plain = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", title).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", plain.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(paths) -> list[str]:
    """Each relative link or image in ``paths`` whose file is missing, or whose #anchor names no heading there."""
    broken = []
    for page in paths:
        text = page.read_text(encoding="utf-8")
        prose = _prose(text)
        for target in LINK.findall(prose) + IMG.findall(prose):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, flags=re.I):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
                broken.append(f"{page.name}: {target}: no heading with that anchor in {dest.name}")
    return broken


def test_every_link_and_anchor_in_readme_and_docs_resolves():
    found = pages()
    assert len(found) > 10  # the README and the docs pages it maps
    assert broken_links(found) == []


def test_a_broken_link_or_anchor_is_caught(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## The answer: `mtpm=auto`\n")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n## Two words\n\n[ok](other.md#the-answer-mtpmauto) [ok](#two-words)\n"
                    "[gone](missing.md) [bad anchor](other.md#the-answer) [bad here](#three-words)\n"
                    "`[in code](nowhere.md)`\n\n```text\n[in a block](nowhere.md)\n```\n")
    broken = broken_links([page])
    assert [b.split(": ")[1] for b in broken] == ["missing.md", "other.md#the-answer", "#three-words"]
