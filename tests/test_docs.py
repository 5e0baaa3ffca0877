"""README.md and docs/ hold together: every relative link reaches a file (and a heading, for a `#`
link), every page in docs/ is in the index, a measured figure has one home and every quotation of it says the
same, code comments and docstrings hold no measured figures, and each checker itself finds what is broken."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from doc_figures import code_figures, figure_problems
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


# --- measured figures: one home each (docs/performance.md, docs/recipes.md and the two study pages) -------------

# Files whose docstrings or comments still hold measured figures, owned by work under way elsewhere; each figure
# goes (or becomes a reference to its home in docs/) and the file leaves this list.
PENDING: tuple[str, ...] = ()  # files whose figures still wait for their move (none)
# Numbers with units in comments and docstrings that are not measurements: settings, examples, sizes, the
# simulator's parameters and the sources it cites.
ALLOWED = {
    "agent_rl/core/deadline.py": ("120 s", "121 s", "1 ms", "1 s"),  # an example deadline; the slices' range
    "agent_rl/core/renderers/base.py": ("40 MB",),  # what the cache's bound in ids comes to
    "agent_rl/learn/allocator.py": ("1 MB", "4 MiB"),  # the thresholds compared
    "agent_rl/learn/models.py": ("8%",),  # what the test model's knob is set for
    "agent_rl/rollout/ray_connect.py": ("5 s",),  # a deadline
    "agent_rl/rollout/remote_gate.py": ("2 s",),  # a deadline
    "agent_rl/rollout/weight_sync/choose.py": ("0.5 s",),  # the push estimate's constant
    "agent_rl/rollout/weight_sync/full.py": ("0.5 GB",),  # a model's size
    "agent_rl/rollout/weight_sync/merged.py": ("0.5 GB",),  # a model's size
    "envs/agent_env.py": ("120 s",),  # a default
    "tools/mcp.py": ("4 KB",),  # what is kept
    "tools/worker_pool.py": ("64 KiB",),  # Linux's default
    "bench/allocator.py": ("1 MB", "4 MiB"),  # the thresholds compared
    "bench/async_sim.py": ("10x",),  # the simulation's parameter
    "bench/deadlines.py": ("120 s",),  # the deadline timed
    "bench/faults.py": ("5%",),  # a default
    "bench/gpu_trainer.py": ("5x",),  # a setting against the init's spread
    "bench/rollout.py": ("100 ms",),  # the tool's sleep
    "bench/shared/sim_measure.py": ("1.5x",),  # a setting
    "bench/shared/sim_servers.py": ("7 ms", "16 GB", "4.8 ms", "7.6 ms", "0.053 ms", "20.5 ms", "30,000 tok/s", "50%",
                             "128 KiB", "50 GB", "5 ms"),  # the simulated H100's parameters and their sources
    "examples/calculator_agent_grpo.yaml": ("10x",),  # a rule of thumb for LoRA's learning rate
    "examples/calculator_grpo.yaml": ("10x",),
    "examples/math_grpo.yaml": ("10x",),
    "examples/calculator_recipe.yaml": ("30%",),  # the setting below it
}


def doc_texts() -> dict[str, str]:
    return {p.relative_to(README.parent).as_posix(): p.read_text() for p in pages()}


def code_files() -> list[str]:
    """The files whose comments and docstrings are scanned, from the repository root (links not followed:
    agent_rl/envs, tools and rewards are the top-level folders)."""
    found = ["Makefile", "pyproject.toml"]
    for top in ("agent_rl", "envs", "tools", "rewards", "bench", "examples"):
        for folder, subfolders, files in os.walk(README.parent / top):
            subfolders[:] = sorted(d for d in subfolders if d != "__pycache__")
            rel = Path(folder).relative_to(README.parent)
            found += [(rel / f).as_posix() for f in sorted(files) if f.endswith((".py", ".yaml"))]
    return found


def test_each_figure_has_one_home_and_every_quote_says_what_it_says():
    assert figure_problems(doc_texts()) == []


def test_the_figure_check_finds_a_drifted_copy():
    home = ("# Recipes\n## Held out\n| accuracy | <!-- figure:acc -->**0.875**<!-- /figure --> |\n\n"
            "Curves: <!-- figure:curve -->0.26, 0.92, 0.999,\n1.0<!-- /figure -->.\n")
    readme = ("| accuracy | <!-- quote:acc -->0.857<!-- /quote --> | [recipes](docs/recipes.md#held-out) |\n\n"
              "Reward <!-- quote:curve -->0.26, 0.92, 0.999, 1.0<!-- /quote --> (no link here).\n\n"
              "<!-- quote:gone -->1<!-- /quote --> [x](docs/recipes.md) <!-- figure:own -->2<!-- /figure -->\n\n"
              "Copied by hand: 0.26, 0.92, 0.999, 1.0.\n")
    assert figure_problems({"docs/recipes.md": home, "README.md": readme}, frozenset({"docs/recipes.md"})) == [
        "README.md: figure:own is not on a home page (docs/recipes.md)",
        "README.md: quote:acc says '0.857', docs/recipes.md says '0.875'",
        "README.md: quote:curve has no link to docs/recipes.md in its paragraph",
        "README.md: quote:gone quotes no figure",
        "README.md: '0.26, 0.92, 0.999, 1.0' is figure:curve of docs/recipes.md, copied without a quote mark",
    ]
    fixed = readme.replace("0.857", "0.875").replace("(no link here)", "([recipes](docs/recipes.md))")
    fixed = fixed.replace("Copied by hand: 0.26, 0.92, 0.999, 1.0.", "").split("<!-- quote:gone")[0]
    assert figure_problems({"docs/recipes.md": home, "README.md": fixed}, frozenset({"docs/recipes.md"})) == []
    two = {"docs/recipes.md": home, "docs/credit.md": "<!-- figure:acc -->0.875<!-- /figure -->"}
    assert figure_problems(two, frozenset(two)) == ["docs/credit.md: figure:acc has a home already, docs/recipes.md"]


def test_code_comments_and_docstrings_hold_no_measured_figures():
    found = [f"{name}:{line}: {figure}" for name in code_files() if name not in PENDING
             for line, figure in code_figures(name, (README.parent / name).read_text())
             if figure not in ALLOWED.get(name, ())]
    assert found == [], ("measured figures belong in docs/performance.md or docs/recipes.md; "
                         "write a reference to the section there instead (or, for a setting, add it to ALLOWED)")


def test_every_allowed_number_is_still_there():
    stale = [f"{name}: {figure}" for name, figures in ALLOWED.items() if name not in PENDING for figure in figures
             if figure not in {f for _, f in code_figures(name, (README.parent / name).read_text())}]
    assert stale == []
    assert set(PENDING) <= set(code_files())


def test_the_code_scan_finds_figures_and_passes_settings():
    source = ('"""Fast.\n\nA turn took 0.31 ms (12% of it parsing), 2.7x the old one, 1,330 turns/s, 2.4 GiB."""\n'
              "TIMEOUT_S = 30  # under 50 ms, at most 3 GB, every 5 ms, 4 x 4 rows, 0x10\n"
              "def f():\n    '''Waits 1.5 s.'''\n    return '9 ms'  # a string is not a comment: 3 s\n")
    assert code_figures("m.py", source) == [(3, "0.31 ms"), (3, "12%"), (3, "2.7x"), (3, "1,330 turns/s"),
                                            (3, "2.4 GiB"), (6, "1.5 s"), (7, "3 s")]
    assert code_figures("Makefile", "x:\n\t@# took 4 min\nA = 5 s\n# 8%\n") == [(2, "4 min"), (4, "8%")]
