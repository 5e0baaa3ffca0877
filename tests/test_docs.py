"""README.md and docs/ hold together: every relative link reaches a file (and a heading, for a `#`
link), every page in docs/ is in the index, and the checker itself finds what is broken."""

from __future__ import annotations

import pytest
from doc_pages import DOCS, README, anchors, broken_links, links, pages


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(README.parent).as_posix())
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_every_page_is_in_the_index():
    index = DOCS / "README.md"
    listed = {t.partition("#")[0] for t in links(index.read_text())}
    assert sorted(p.name for p in DOCS.glob("*.md") if p.name not in listed | {"README.md"}) == [], \
        "pages missing from docs/README.md: add a line for each under the heading a reader would look for it"
    assert "docs/README.md" in links(README.read_text())


def test_anchors_follow_github():
    text = "# Two commands\n## The recipe: cold-start SFT, then GRPO\n## `agent-rl` (a study)\n## Notes\n## Notes\n" \
           "```python\n# not a heading\n```\n"
    assert anchors(text) == {"two-commands", "the-recipe-cold-start-sft-then-grpo", "agent-rl-a-study", "notes",
                             "notes-1"}


def test_the_checker_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other\n## Real heading\n")
    (tmp_path / "pic.png").write_bytes(b"")
    page = tmp_path / "docs" / "page.md"
    page.write_text("# Page\n[ok](other.md#real-heading) [gone](missing.md) [no heading](other.md#nope) "
                    "[here](#page) [not here](#elsewhere) ![img](../pic.png) ![no img](pic.png) "
                    "[web](https://example.org/x) `[code](missing-too.md)`\n"
                    "```bash\n[block](missing-three.md)\n```\n")
    assert broken_links(page) == ["page.md: missing.md (no file missing.md)",
                                  "page.md: other.md#nope (no heading #nope in other.md)",
                                  "page.md: #elsewhere (no heading #elsewhere in page.md)",
                                  "page.md: pic.png (no file pic.png)"]
