"""The documentation as the tests read it: README.md and the pages in docs/, the marked blocks in them,
and their relative links.

Owns: finding the one page that holds a marked block (`<!-- example:NAME -->` around a python block,
`<!-- commands:NAME -->` around a bash block), so a test follows a block to whichever page it lives on, and a
commands block's lines (`readme_commands`);
the links of a page and GitHub's heading anchors, for the link test.
Does not own: running the blocks (tests/test_readme_example.py, tests/test_readme_mixture_judge.py).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def pages() -> list[Path]:
    """README.md, then every page in docs/ (its index included), in name order."""
    return [README, *sorted(DOCS.glob("*.md"))]


def page_with(marker: str) -> Path:
    """The one page that holds `marker`; a block on no page, or on two, fails the test that asks."""
    found = [p for p in pages() if marker in p.read_text()]
    assert len(found) == 1, f"{marker} is on {len(found)} pages of README.md and docs/ (expected one): {found}"
    return found[0]


def marked_block(kind: str, name: str) -> str:
    """The body of the `<!-- kind:name -->` block: python for `example`, bash for `commands`."""
    lang = {"example": "python", "commands": "bash"}[kind]
    page = page_with(f"<!-- {kind}:{name} -->")
    block = re.search(rf"<!-- {kind}:{name} -->\n```{lang}\n(.*?)```\n<!-- /{kind}:{name} -->", page.read_text(),
                      re.DOTALL)
    assert block, f"{page.name}: the {kind}:{name} block is not a ```{lang} block between its two markers"
    return block.group(1)


def readme_commands(name: str) -> list[str]:
    """The command lines of the `commands:<name>` block (README.md or docs/), comments dropped."""
    return [re.sub(r"\s+# .*$", "", line) for line in marked_block("commands", name).splitlines() if line.strip()]


def unfenced(text: str) -> str:
    """Markdown without its fenced blocks (a `# comment` in a python block is no heading)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def prose(text: str) -> str:
    """Markdown without fenced blocks and code spans: what is left can hold links."""
    return re.sub(r"`[^`\n]*`", "", unfenced(text))


def anchors(text: str) -> set[str]:
    """GitHub's anchor of every heading: lower case, punctuation dropped, spaces to hyphens, and
    -1, -2, ... after a repeated one."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+?)\s*$", unfenced(text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return out


def links(text: str) -> list[str]:
    """Targets of the inline links and images of a page, code left out."""
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", prose(text))


def broken_links(page: Path) -> list[str]:
    """Each relative link of `page` that reaches no file, or no heading of its file: `page: target (why)`."""
    broken = []
    for target in links(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto: ... are not checked here
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.is_file():
            broken.append(f"{page.name}: {target} (no file {path})")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            broken.append(f"{page.name}: {target} (no heading #{anchor} in {file.name})")
    return broken
