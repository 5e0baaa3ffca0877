"""The `agent-rl view` page in a real headless Chromium: it opens from a file with no network, lists
the steps, shows one trajectory's turns with sampled text set apart, marks failures and truncations,
and shows hostile model text as text.

Needs the `browser` extra (playwright) and Debian's Chromium (`apt-get install chromium`, or
AGENT_RL_CHROMIUM); skipped with that reason where either is missing.
"""

from __future__ import annotations

import importlib.util
import os
import shutil

import pytest
from helpers import HOSTILE, PLAN

from agent_rl.learn.advantages import group_advantages
from agent_rl.runs import traces, view


def _no_browser() -> str | None:
    if importlib.util.find_spec("playwright") is None:
        return "the playwright package is not installed (pip install -e '.[browser]')"
    if not (os.environ.get("AGENT_RL_CHROMIUM") or shutil.which("chromium")):
        return "no Chromium binary (apt-get install -y chromium, or set AGENT_RL_CHROMIUM)"
    return None


pytestmark = pytest.mark.skipif(_no_browser() is not None, reason=str(_no_browser()))


@pytest.fixture
async def browser():
    from playwright.async_api import async_playwright

    chromium = os.environ.get("AGENT_RL_CHROMIUM") or shutil.which("chromium")
    async with async_playwright() as p:
        b = await p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"], timeout=60_000)
        try:
            yield b
        finally:
            await b.close()


async def open_page(browser, url: str):
    page = await browser.new_page()
    page.set_default_timeout(10_000)
    requests, errors = [], []
    page.on("request", lambda r: requests.append(r.url))
    page.on("pageerror", lambda e: errors.append(str(e)))
    await page.goto(url)
    return page, requests, errors


async def texts(page, selector: str) -> list[str]:
    return await page.locator(selector).all_inner_texts()


async def background(page, selector: str) -> str:
    return await page.locator(selector).first.evaluate("e => getComputedStyle(e).backgroundColor")


async def test_page_lists_steps_and_shows_a_trajectorys_turns(tmp_path, play_plan, renderer, browser):
    groups = await play_plan(PLAN)
    adv = group_advantages(groups)
    for step in (1, 2):
        traces.write_step(tmp_path, step, groups, adv, renderer, keep_groups=4)
    path = view.write_page(tmp_path)
    page, requests, errors = await open_page(browser, path.as_uri())

    steps = await texts(page, "#step-list li")
    assert [s.split()[:2] for s in steps] == [["step", "1"], ["step", "2"]]
    assert "1 error" in steps[0] and "1 truncated" in steps[0]  # the crash, the rambling episode
    await page.click('#step-list li[data-step="2"]')
    assert await page.locator("#step-list li.selected").get_attribute("data-step") == "2"
    assert await page.locator("#groups .group").count() == 4

    await page.click('tr.traj[data-group="0"][data-index="0"]')  # t-learn: a tool call, then the answer
    assert "task t-learn" in await page.locator("#detail h2").inner_text()
    assert [await m.get_attribute("data-role") for m in await page.locator("#turns .msg").all()] == \
        ["system", "user", "assistant", "tool", "assistant"]
    sampled = await texts(page, "#turns .msg.sampled pre")
    assert len(sampled) == 2 and '"name": "add"' in sampled[0] and sampled[1] == "It is 5."
    assert await texts(page, "#turns .msg.tool pre") == ["5"]
    record = next(r for r in traces.read_traces(tmp_path)[2] if r["group"] == 0 and r["index"] == 0)
    runs = record["segments"][0]["runs"]
    assert await page.locator(".run.sampled").count() == sum(r["sampled"] for r in runs) == 2
    assert await page.locator(".run.context").count() == sum(not r["sampled"] for r in runs)
    # sampled text is visibly apart: its own colour, in the turns and in the tokens
    assert await background(page, ".run.sampled") != await background(page, ".run.context")
    assert await background(page, ".msg.sampled") != await background(page, ".msg.prompt")
    assert await background(page, ".msg.sampled") != await background(page, ".msg.tool")

    crash, cut = (page.locator('tr.traj[data-group="2"][data-index="1"]'),
                  page.locator('tr.traj[data-group="3"][data-index="0"]'))
    assert "failed" in await crash.get_attribute("class") and await crash.locator(".badge.error").count() == 1
    assert "truncated" in await cut.get_attribute("class") and await cut.locator(".badge.truncated").count() == 1
    await cut.click()
    assert await page.locator("#turns .msg.sampled.cut").count() == 1  # the turn cut by max_tokens
    await crash.click()
    assert "sampler went away" in await page.locator("#detail .error-box").inner_text()

    await page.fill("#task-filter", "t-cut")
    assert await page.locator("#groups .group").count() == 1
    await page.fill("#task-filter", "")
    await page.check("#only-failures")
    assert await texts(page, "#groups .group-head b") == ["task t-crash", "task t-cut"]
    assert not errors and all(u.startswith("file://") for u in requests), (errors, requests)


async def test_hostile_model_text_is_shown_not_run(tmp_path, play_plan, renderer, browser):
    groups = await play_plan({"t-cut": PLAN["t-cut"]})
    traces.write_step(tmp_path, 1, groups, group_advantages(groups), renderer, keep_groups=1)
    path = view.write_page(tmp_path)
    # a link to one trajectory opens it
    page, requests, errors = await open_page(browser, path.as_uri() + "#step=1&group=0&index=1")
    assert (await texts(page, "#turns .msg.sampled pre"))[-1] == HOSTILE
    assert HOSTILE in await page.locator(".run.sampled").last.inner_text()
    assert await page.evaluate("window.__pwned") is None
    assert await page.locator("img").count() == 0 and await page.locator("script").count() == 2
    assert not errors and len(requests) == 1, (errors, requests)


async def test_an_evaluations_replies_page_shows_each_policy_and_its_verdicts(tmp_path, play_plan, renderer,
                                                                             browser):
    from agent_rl.runs.replies import write_replies

    groups = await play_plan({"t-learn": ["bad_call_then_right", "wrong"]})
    first, second = groups[0].trajectories
    path = write_replies(tmp_path / "eval.replies.jsonl", {
        "base": [(first, {"valid": True, "error_type": None, "errors": []}),
                 (second, {"valid": False, "error_type": "multi_turn:force_terminated", "errors": ["3 of 4 turns"]})],
        "runs/sft": [(first, None)]}, renderer)
    page, requests, errors = await open_page(browser, view.write_page(path).as_uri())
    steps = await texts(page, "#step-list li")
    assert [s.split()[:3] for s in steps] == [["base", "valid", "0.5"], ["runs/sft", "reward", "\u2014"]]
    assert await texts(page, "#groups table th") == ["#", "reward", "verdict", "stop", "turns", "sampled / tokens",
                                                      "tool calls"]
    assert [t.split("\t")[2] for t in await texts(page, "tr.traj")] == ["valid", "multi_turn:force_terminated"]
    await page.click('tr.traj[data-group="0"][data-index="1"]')
    assert "invalid: multi_turn:force_terminated \u00b7 3 of 4 turns" in await page.locator("#detail dl").inner_text()
    await page.click('tr.traj[data-group="0"][data-index="0"]')
    heads = await texts(page, "#turns .msg.sampled .msg-head")
    assert heads[0].endswith("violations: malformed_call") and "violations" not in heads[1]
    assert not errors and all(u.startswith("file://") for u in requests), (errors, requests)
