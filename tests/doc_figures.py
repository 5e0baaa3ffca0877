"""Measured figures and where they live, as the tests read them.

A measured figure (a timing, a speed-up, a held-out accuracy, a throughput, a wall time) has one home: a page of
`HOMES`. A figure that another page repeats is marked at its home, `<!-- figure:KEY -->TEXT<!-- /figure -->`,
and at each copy, `<!-- quote:KEY -->TEXT<!-- /quote -->`, with a link to the home in the copy's paragraph (or
table). The marks are HTML comments: GitHub shows only TEXT.

Owns: reading those marks and judging them (`figure_problems`: a figure outside a home or with two homes, a
quote of no figure, a quote whose text differs from its home's or that does not link there, a figure's text
copied without a mark); finding measured-looking numbers (a number with a unit of time, speed or size, a
speed-up such as `2.7x`, a share in %) in the `#` comments and docstrings of code (`code_figures`).
Does not own: which pages and files are read, and which numbers are allowed (tests/test_docs.py).
"""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize
from dataclasses import dataclass

from doc_pages import links

HOMES = frozenset({"docs/performance.md", "docs/recipes.md", "docs/coding-recipe.md", "docs/credit.md"})
MARK = re.compile(r"<!-- (figure|quote):([a-z0-9][a-z0-9.-]*) -->(.*?)<!-- /\1 -->", re.S)
NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
UNIT = r"(?:us|µs|ms|s|sec|seconds?|min|minutes?|h|hours?|tok/s|tokens/s|turns/s|KiB|MiB|GiB|KB|MB|GB|%)"
# a number with a unit of time, speed, size or share after it (`0.18 ms`, `61 tok/s`, `2,478 MiB`, `42%`), or a
# ratio written as `2.7x`; `4 x 4` (a shape) and `0x10` are not
FIGURE = re.compile(rf"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:\s?{UNIT}(?![\w/])|x(?!\w))")
BOUND = re.compile(r"(?:<=|>=|<|>|\bunder|\bat most|\bup to|\bevery|\bwithin)\s*~?$")


@dataclass(frozen=True)
class Mark:
    """One figure or quote mark: its page, its key, its text and the paragraph (or table) it sits in."""

    kind: str
    key: str
    text: str
    page: str
    paragraph: str


def normal(text: str) -> str:
    """A figure's text as compared: emphasis and line breaks do not count, digits and words do."""
    return " ".join(text.replace("*", "").split())


def marks(page: str, text: str) -> list[Mark]:
    """Every figure and quote mark of a page, in order."""
    found = []
    for m in MARK.finditer(text):
        start = text.rfind("\n\n", 0, m.start()) + 2 if "\n\n" in text[:m.start()] else 0
        end = text.find("\n\n", m.end())
        found.append(Mark(m.group(1), m.group(2), m.group(3), page, text[start:end if end >= 0 else len(text)]))
    return found


def links_to(mark: Mark, home: str) -> bool:
    """Whether the mark's paragraph links to the page `home` (an anchor alone links to its own page)."""
    for target in links(mark.paragraph):
        path = target.partition("#")[0]
        if re.match(r"[a-z]+:", target):
            continue
        if (os.path.normpath(os.path.join(os.path.dirname(mark.page), path)) if path else mark.page) == home:
            return True
    return False


def figure_problems(pages: dict[str, str], homes: frozenset[str] = HOMES) -> list[str]:
    """What is wrong with the figure marks of `pages` (path from the repository root -> text), one line each."""
    found = [m for page, text in pages.items() for m in marks(page, text)]
    problems, home_of = [], {}
    for m in found:
        if m.kind != "figure":
            continue
        if m.page not in homes:
            problems.append(f"{m.page}: figure:{m.key} is not on a home page ({', '.join(sorted(homes))})")
        elif m.key in home_of:
            problems.append(f"{m.page}: figure:{m.key} has a home already, {home_of[m.key].page}")
        else:
            home_of[m.key] = m
    for m in found:
        home = home_of.get(m.key)
        if m.kind != "quote":
            continue
        if home is None:
            problems.append(f"{m.page}: quote:{m.key} quotes no figure")
        elif normal(m.text) != normal(home.text):
            problems.append(f"{m.page}: quote:{m.key} says {normal(m.text)!r}, {home.page} says {normal(home.text)!r}")
        elif not links_to(m, home.page):
            problems.append(f"{m.page}: quote:{m.key} has no link to {home.page} in its paragraph")
    for key, home in home_of.items():
        if len(NUMBER.findall(home.text)) < 2:
            continue  # one number alone (`0.875`) is too common to look for
        for page, text in pages.items():
            if normal(home.text) in normal(MARK.sub(" ", text)):
                problems.append(f"{page}: {normal(home.text)!r} is figure:{key} of {home.page}, "
                                "copied without a quote mark")
    return problems


def comment_lines(name: str, text: str) -> list[tuple[int, str]]:
    """(line, text) of every `#` comment and docstring line of a Python file, or of every `#` comment of a
    Makefile, TOML or YAML file."""
    if not name.endswith(".py"):
        return [(n, m.group(1)) for n, line in enumerate(text.splitlines(), 1)
                if (m := re.search(r"(?:^|\s|@)#(.*)$", line))]
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(text).readline)
           if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            doc = first.value.value if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) else None
            if isinstance(doc, str):
                out += [(first.lineno + i, line) for i, line in enumerate(doc.splitlines())]
    return sorted(out)


def code_figures(name: str, text: str) -> list[tuple[int, str]]:
    """(line, number with its unit) of each measured-looking figure in the comments and docstrings of a file. A
    bound or an interval (`<= 20 ms`, `under 50 ms`, `up to 32 MB`, `every 5 ms`) is a setting, not a figure."""
    return [(line, m.group(0)) for line, comment in comment_lines(name, text) for m in FIGURE.finditer(comment)
            if not BOUND.search(comment, 0, m.start())]
