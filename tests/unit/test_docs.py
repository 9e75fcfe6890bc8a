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


# -- sentences cut apart: a page or section that begins mid-sentence, a sentence broken off by a heading ------------

BLOCK_START = re.compile(r"^ {0,3}(#{1,6} |`{3,}|~{3,})")


def _blocks(text: str) -> list[tuple[str, str, str]]:
    """The page's blocks in order, each (kind, first line, last line): heading, code, table, list, html or para."""
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
            continue
        fence = re.match(r"^ {0,3}(`{3,}|~{3,})", line)
        if fence:
            j = i + 1
            while j < len(lines) and not lines[j].lstrip().startswith(fence.group(1)):
                j += 1
            out.append(("code", line, lines[min(j, len(lines) - 1)]))
            i = j + 1
            continue
        if HEADING.match(line):
            out.append(("heading", line, line))
            i += 1
            continue
        j = i + 1
        while j < len(lines) and lines[j].strip() and not BLOCK_START.match(lines[j]):
            j += 1
        first = line.lstrip()
        kind = ("table" if first.startswith("|") else "list" if re.match(r"([-*+]|\d+\.) ", first)
                else "html" if first.startswith("<") else "para")
        out.append((kind, line, lines[j - 1]))
        i = j
    return out


def cut_sentences(text: str) -> list[str]:
    """Where a page reads as cut apart: a paragraph that begins with a lower-case word (the rest of a sentence), a
    section whose first paragraph begins with a parenthesis, a paragraph or list that stops without punctuation just
    before a heading, and a paragraph ending in a colon that introduces nothing (prose or a heading follows)."""
    found = []
    blocks = _blocks(text)
    for k, (kind, first, last) in enumerate(blocks):
        if kind not in ("para", "list"):
            continue
        before = blocks[k - 1][0] if k else None
        after = blocks[k + 1][0] if k + 1 < len(blocks) else None
        lead, tail = first.strip(), last.rstrip()
        if kind == "para" and re.match(r"[a-z]", lead):
            found.append(f"begins mid-sentence: {lead[:60]!r}")
        if before == "heading" and lead.startswith("("):
            found.append(f"a section begins mid-sentence: {lead[:60]!r}")
        if after == "heading" and not re.search(r"([.:!?)`|*>]|\.\*\*)$", tail):
            found.append(f"breaks off before a heading: {tail[-60:]!r}")
        if kind == "para" and tail.endswith(":") and after in ("para", "heading"):
            found.append(f"a colon introduces nothing: {tail[-60:]!r}")
    return found


def test_no_page_begins_or_breaks_off_mid_sentence():
    cut = [f"{page.relative_to(REPO)}: {c}" for page in pages()
           for c in cut_sentences(page.read_text(encoding="utf-8"))]
    assert cut == []


def test_a_cut_sentence_is_caught():
    page = ("# Page\n\nplans in seconds whatever its lengths.\n\n## One\n\nA million sequences plan in\n\n## Two\n\n"
            "(SIGKILL) cannot write.\n\nTwo knobs decide it:\n\nWith a budget, balanced.\n\n"
            "Fine: a list follows:\n\n- `item` ends well.\n\n```text\nlower case in a block\n```\n")
    assert [c.split(":")[0] for c in cut_sentences(page)] == [
        "begins mid-sentence", "breaks off before a heading", "a section begins mid-sentence",
        "a colon introduces nothing"]


# -- each fact in one place -------------------------------------------------------------------------------------------
# A fact a reader needs in several places is stated on its home page; the others link there. Each entry: the pages
# that may state it (its home, and the dated write-up that measured it) and what a sentence stating it looks like.
# conf/ comments count too: a preset's comment once said "about a day" where the page said "about 14 hours".

FACTS: dict[str, tuple[set[str], list[str]]] = {
    "make run's time": ({"README.md", "docs/measurements/2026-12-03-make-run.md"},
                        [r"make run", r"\b(\d+(\.\d+)? ?(s|min|minutes|seconds)|an? (minute|hour))\b"]),
    "the committed tables regenerated and checked": (
        {"docs/reports.md"}, [r"--readme README\.md|--check", r"\b(rewrites?|exits? 1|fails?|stale|no longer match)"]),
    "how to read an interval": ({"docs/measurement.md"}, [r"√2 times|89% of the time"]),
    "the peak-memory reset": ({"docs/precision.md"}, [r"\bpeak", r"\breset"]),
    "what each backend does": ({"docs/architecture.md"}, [r"fully_shard|DistributedDataParallel"]),
    "the checkpoint's size": ({"docs/gpus.md"},
                              [r"\b\d+(\.\d+)? ?(GB|GiB)\b", r"checkpoint|35B|replica|copy of the model"]),
    "pairing's cost at the published scale": ({"docs/gpus.md"},
                                              [r"\bpair", r"\b(an hour|hours|a day)\b"]),
}
GENERATED = re.compile(r"<!-- results:begin -->.*?<!-- results:end -->|<!--.*?-->", flags=re.S)


def fact_files() -> list[Path]:
    return [*pages(), *sorted((REPO / "harness" / "conf").rglob("*.yaml"))]


def _sentences(path: Path) -> list[str]:
    """The sentences a reader sees: Markdown without code blocks, generated blocks or comments (code spans keep their
    text), or a YAML file's comments."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".yaml":
        text = "\n".join(line.split("#", 1)[1] for line in text.splitlines() if "#" in line)
    else:
        text = FENCE.sub("", GENERATED.sub("", text)).replace("`", "")
    text = re.sub(r"\s+", " ", "\n".join(line.strip() for line in text.split("\n\n")))
    return re.split(r"(?<=[.!?])\s+(?=[A-Z(\[*_])|\s\|\s", text)


def fact_places(paths, facts=FACTS) -> dict[str, set[str]]:
    """For each fact, the files (relative to the repository) that state it outside its home."""
    out: dict[str, set[str]] = {}
    for path in paths:
        name = path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path.name
        for sentence in _sentences(path):
            for fact, (home, patterns) in facts.items():
                if name not in home and all(re.search(p, sentence) for p in patterns):
                    out.setdefault(fact, set()).add(name)
    return out


def test_each_registered_fact_is_stated_on_its_home_page_only():
    assert fact_places(fact_files()) == {}


# A duration or size stated on a guide page (README.md, docs/*.md but the dated write-ups) is one fact: the same
# figure on a second page is that fact twice. A single digit ("every 5 s") is too common to tell; figures that are
# different facts, equal by chance:
# 60 s: the per-test limit and Triton's autotune per dtype and layout; 22 s: fla's first call on a V100 and an eager
# compile cell
SAME_FIGURE_OTHER_FACT = {("30", "s"), ("60", "s"), ("22", "s")}
FIGURE = re.compile(r"(?<![\w.,])(\d{2,3}(?:,\d{3})*(?:\.\d+)?|\d\.\d+|\d,\d{3}(?:,\d{3})*) ?"
                    r"(GB|GiB|s|min|minutes|hours|tok/s)\b")


def repeated_figures(paths) -> dict[tuple[str, str], list[str]]:
    """Each figure (number, unit) on a guide page that another page states too, with the pages."""
    where: dict[tuple[str, str], set[str]] = {}
    for path in paths:
        name = path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path.name
        for m in FIGURE.finditer(_prose(GENERATED.sub("", path.read_text(encoding="utf-8")))):
            where.setdefault((m.group(1), m.group(2)), set()).add(name)
    return {figure: sorted(names) for figure, names in where.items()
            if len(names) > 1 and figure not in SAME_FIGURE_OTHER_FACT
            and any("measurements/" not in n for n in names)}


def test_a_figure_on_a_guide_page_is_stated_once():
    assert repeated_figures(pages()) == {}


def test_a_fact_stated_twice_is_caught(tmp_path):
    home, other = tmp_path / "home.md", tmp_path / "other.md"
    home.write_text("# Home\n\n`make run` takes about 4 minutes (252 s measured). Loads read the 67 GB checkpoint.\n")
    other.write_text("# Other\n\nThe workload keeps `make run` within 5 minutes.\n\nIt took 252 s.\n\n"
                     "```text\nmake run  # 252 s in a block is not prose\n```\n")
    facts = {"make run's time": ({"home.md"}, FACTS["make run's time"][1]),
             "the checkpoint's size": ({"other.md"}, FACTS["the checkpoint's size"][1])}
    assert fact_places([home, other], facts) == {"make run's time": {"other.md"}, "the checkpoint's size": {"home.md"}}
    assert repeated_figures([home, other]) == {("252", "s"): ["home.md", "other.md"]}
