"""README.md is a short front door and the docs/ pages hold the rest: the README stays within 200 lines, opens
with the two set-up commands, and no relative link in it or in docs/*.md points at a missing file or heading
(a page moved or a heading renamed breaks a link silently otherwise).  Reads files only: no torch, no network."""
from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 200

FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})")
INLINE_CODE = re.compile(r"(`+)((?:(?!\n\s*\n).)+?)\1", re.S)
# [text](target) or [text](target "title"); images (![alt](src)) are links to files too
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s<>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"""<a\s+(?:name|id)\s*=\s*["']([^"']+)["']""", re.I)


def markdown_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fence = None
    for n, line in enumerate(text.split("\n"), 1):
        m = FENCE.match(line)
        if m:
            mark = m.group(2)
            if fence is None:
                fence = mark[0] * len(mark)
            elif mark[0] == fence[0] and len(mark) >= len(fence) and not line.strip()[len(mark):].strip():
                fence = None
            continue
        if fence is None:
            yield n, line


def first_fenced_block(text: str) -> str:
    lines = text.split("\n")
    for i, line in enumerate(lines):
        m = FENCE.match(line)
        if m:
            mark = m.group(2)
            body = []
            for rest in lines[i + 1:]:
                if rest.strip().startswith(mark[0] * len(mark)):
                    return "\n".join(body)
                body.append(rest)
            return "\n".join(body)
    return ""


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)      # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)                                # inline HTML
    text = text.replace("`", "").lower()
    out = []
    for ch in text:
        if ch in " -_" or ch.isalnum() or unicodedata.category(ch).startswith("M"):
            out.append("-" if ch == " " else ch)
    return "".join(out)


def anchors(path: Path) -> set[str]:
    """Every anchor of a markdown file: its headings' slugs (repeats numbered -1, -2, ... as GitHub does) and
    explicit <a name=...> / id= anchors."""
    seen: dict[str, int] = {}
    found = set()
    text = path.read_text(encoding="utf-8")
    for _, line in prose_lines(text):
        m = HEADING.match(line)
        if m:
            slug = github_slug(m.group(2))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
        found.update(a.lower() for a in HTML_ANCHOR.findall(line))
    return found


def links(path: Path):
    """(line number, target) of every markdown link outside code: fenced blocks, and inline code spans, which
    may run over a line break inside a paragraph."""
    text = path.read_text(encoding="utf-8")
    prose = dict(prose_lines(text))
    lines = [prose.get(n, "") for n in range(1, len(text.split("\n")) + 1)]
    blanked = INLINE_CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), "\n".join(lines))
    for m in LINK.finditer(blanked):
        yield blanked.count("\n", 0, m.start()) + 1, m.group(1)


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines, at most {MAX_README_LINES}: move the topic to a page under docs/")


def test_readme_opens_with_the_setup_commands():
    block = first_fenced_block(README.read_text(encoding="utf-8"))
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert any(c.startswith("make demo") for c in commands), f"README's first code block lacks `make demo`: {block!r}"
    assert any(c.startswith("make test") for c in commands), f"README's first code block lacks `make test`: {block!r}"


@pytest.mark.parametrize("page", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    broken = []
    anchor_cache: dict[Path, set[str]] = {}
    for n, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):       # http(s):, mailto:, ...: not checked here
            continue
        file_part, _, anchor = target.partition("#")
        file_part = unquote(file_part)
        dest = page if not file_part else (page.parent / file_part).resolve()
        where = f"{page.relative_to(ROOT)}:{n}: {target}"
        if not dest.exists():
            broken.append(f"{where}: no such file")
            continue
        try:
            dest.relative_to(ROOT)
        except ValueError:
            broken.append(f"{where}: outside the repository")
            continue
        if anchor and dest.suffix.lower() == ".md":
            if dest not in anchor_cache:
                anchor_cache[dest] = anchors(dest)
            if unquote(anchor).lower() not in anchor_cache[dest]:
                broken.append(f"{where}: no heading with that anchor in {dest.relative_to(ROOT)}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_slugs_follow_github():
    assert github_slug("Which models the FP8 / MXFP4 kernels touch") == "which-models-the-fp8--mxfp4-kernels-touch"
    assert github_slug("Quantised indexer keys: `quant_lightning_indexer`") == (
        "quantised-indexer-keys-quant_lightning_indexer")
    assert github_slug("FlashMLA's FP8 caches") == "flashmlas-fp8-caches"
    assert github_slug("`make demo` and `make test`") == "make-demo-and-make-test"
