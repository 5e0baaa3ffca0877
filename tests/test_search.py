"""Full-text search over the real country articles: ranking, snippets, hostile queries, remote path, CLI."""

from __future__ import annotations

import re
import time

import aiohttp
import pytest

from agent_rl.tools.base import Tool, ToolError
from agent_rl.tools.countries import country_articles
from agent_rl.tools.search import LocalSearch, RemoteSearch, SearchIndex, query_terms, search_cli
from agent_rl.tools.search_service import start_search_service


@pytest.fixture(scope="module")
def index_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("search") / "countries.sqlite"
    start = time.perf_counter()
    SearchIndex.build(path).close()
    print(f"\nindex build: {time.perf_counter() - start:.3f} s")
    return path


@pytest.fixture(scope="module")
def local(index_path):
    index = SearchIndex(index_path)
    yield LocalSearch(index)
    index.close()


def titles(text: str) -> list[str]:
    return re.findall(r"^\[\d+\] (.+)$", text, flags=re.M)


def test_articles_are_one_per_country_and_state_facts():
    articles = country_articles()
    assert len(articles) == len({a.title for a in articles}) > 240
    france = dict(articles)["France"]
    assert "Its capital is Paris." in france and "Germany" in france


def test_index_is_built_once_and_reopened(index_path, tmp_path):
    stamp = index_path.stat().st_mtime_ns
    reopened = SearchIndex.open_or_build(index_path)
    assert reopened.size == len(country_articles()) and index_path.stat().st_mtime_ns == stamp
    reopened.close()
    not_index = tmp_path / "other.sqlite"
    not_index.write_text("hello")
    with pytest.raises(ValueError, match="not a countries-fts-1 search index"):
        SearchIndex(not_index)
    with pytest.raises(FileNotFoundError, match="no search index"):
        SearchIndex(tmp_path / "missing.sqlite")


@pytest.mark.parametrize(
    "query, top",
    [("capital Paris", "France"), ("Berlin", "Germany"), ("Which country's capital is Canberra?", "Australia"),
     ('"Tokyo" AND (capital OR *', "Japan"), ("cote d'ivoire", "Ivory Coast")],
)
async def test_top1_article(local, query, top):
    assert titles(await local.search(query, k=3))[0] == top


async def test_snippets_are_titled_and_highlight_the_terms(local):
    text = await local.search("capital Paris", k=3)
    assert text.startswith("Top 3 results for 'capital Paris':")
    blocks = re.findall(r"^\[(\d+)\] (.+)\n(.+)$", text, flags=re.M)
    assert [b[0] for b in blocks] == ["1", "2", "3"]
    assert "**Paris**" in blocks[0][2] and all("**capital**" in b[2] for b in blocks)


HOSTILE = ['"', "", "   ", "*", ")(", "AND OR NOT", "NEAR(", "-", "^:", "'; DROP TABLE articles; --"]


@pytest.mark.parametrize("query", HOSTILE)
async def test_hostile_queries_never_raise(local, query):
    text = await local.search(query)
    assert "no searchable words" in text or "No article matches" in text, text


@pytest.mark.parametrize("query", ["日本", "zzzzqqq", "ÅÆØ émigré", "x" * 5000])
async def test_unmatched_queries_say_what_was_searched(local, query):
    text = await local.search(query)
    assert text.startswith(f"No article matches {query!r}") and "Try fewer or different keywords" in text


def test_query_terms_are_plain_words():
    assert query_terms('"Paris" AND (capital OR *)') == ["paris", "capital"]
    assert query_terms("what is the") == ["what", "is", "the"]  # only stop words: keep them
    assert query_terms("a_b  NEAR(x)") == ["b", "near", "x"]


async def test_as_a_tool(local):
    tool = Tool(local.search)
    assert tool.name == "search" and set(tool.schema["function"]["parameters"]["properties"]) == {"query", "k"}
    result = await tool.call({"query": "capital Paris", "k": 1})
    assert result.ok and titles(result.content) == ["France"]
    bad = await tool.call({"query": "Paris", "k": 0})
    assert not bad.ok and "k must be an integer from 1 to 20" in bad.content


async def test_remote_search_matches_local(index_path, local):
    async with await start_search_service(index_path) as service:
        assert service.url.startswith("http://127.0.0.1:")
        async with RemoteSearch(service.url, timeout_s=5) as remote:
            for query in ["capital Paris", ')(', "日本", "Berlin", "Paris " * 2000]:
                assert await remote.search(query, k=4) == await local.search(query, k=4)
            with pytest.raises(ToolError, match="k must be"):
                await remote.search("Paris", k=99)
        async with RemoteSearch(service.url + "/v2", timeout_s=5) as wrong:
            with pytest.raises(ToolError, match="answered 404: unknown endpoint /v2/search; endpoints: /search"):
                await wrong.search("Paris")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            async with http.get(service.url + "/search", params={"q": "Paris", "k": "many"}) as resp:
                assert resp.status == 400 and "'k' must be int" in (await resp.json())["error"]
    async with RemoteSearch(service.url, timeout_s=5) as remote:  # the service is gone now
        with pytest.raises(ToolError, match=f"search service at {service.url} failed"):
            await remote.search("Paris")


def test_search_cli(tmp_path, capsys):
    path = tmp_path / "cli" / "index.sqlite"
    assert search_cli("capital Paris", 2, str(path)) == 0
    out, err = capsys.readouterr()
    assert titles(out)[0] == "France" and "built search index" in err and path.exists()
    assert search_cli("Paris", 0, str(path)) == 2
    assert "k must be" in capsys.readouterr().err
