"""Knowledge graph on the real country facts: triples, QA pairs, the HTTP service and the client tool."""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
import time

import aiohttp
import pytest

from agent_rl.tools.countries import Triple, country_triples, entity_key, qa_pairs
from agent_rl.tools.kg import KGClient
from agent_rl.tools.kg_service import KGStore, kg_serve_cli, start_kg_service


@pytest.fixture(scope="module")
def triples() -> list[Triple]:
    return country_triples()


@pytest.fixture(scope="module")
def db_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("kg") / "kg.sqlite"
    KGStore.build(path).close()
    return path


@pytest.fixture(scope="module")
async def url(db_path):
    async with await start_kg_service(db_path, port=0) as service:
        yield service.url


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


async def get(http, url, path, **params):
    async with http.get(url + path, params=params) as resp:
        return resp.status, await resp.json()


# --- the data ---


def test_triples_are_deterministic_and_hold_known_facts(triples):
    assert triples == country_triples() and len(triples) > 6000
    facts = {(t.subject, t.relation, t.object) for t in triples}
    assert {("France", "capital", "Paris"), ("Germany", "borders", "France"), ("Japan", "region", "Asia"),
            ("France", "language", "French"), ("Italy", "currency", "EUR")} <= facts
    borders = {(t.subject, t.object) for t in triples if t.relation == "borders"}
    assert all((b, a) in borders for a, b in borders)  # closed under symmetry
    inverse = {(t.subject, t.relation, t.object) for t in country_triples(inverse=True)}
    assert ("Paris", "capital_of", "France") in inverse and ("Europe", "region_of", "France") in inverse
    assert not any(r == "population_of" for _, r, _ in inverse)  # literals get no inverse edge


def test_entity_keys_ignore_case_accents_and_punctuation():
    assert entity_key("  Côte d'Ivoire ") == "cote d ivoire" == entity_key("COTE-D'IVOIRE")


def test_qa_pairs_are_seeded_and_answers_follow_from_the_triples(triples):
    facts = set(triples)
    pairs = qa_pairs(triples, 200, seed=3)
    assert pairs == qa_pairs(triples, 200, seed=3) != qa_pairs(triples, 200, seed=4)
    assert {qa.hops for qa in pairs} == {1, 2} and len({qa.question for qa in pairs}) == 200
    for qa in pairs:
        assert len(qa.triples) == qa.hops and set(qa.triples) <= facts
        assert qa.answer == qa.triples[-1].object
        if qa.hops == 2:  # the first hop lands on the country the second hop starts from
            first, second = qa.triples
            assert second.subject in (first.subject, first.object)
        # the answer is the only value of its relation for that country
        last = qa.triples[-1]
        assert [t.object for t in triples if (t.subject, t.relation) == (last.subject, last.relation)] == [qa.answer]
    q = next(qa for qa in qa_pairs(triples, 974, seed=0, hops=1) if qa.question == "What is the capital of France?")
    assert q.answer == "Paris"
    two = [qa for qa in qa_pairs(triples, 716, seed=0, hops=2) if "whose capital is Paris" in qa.question]
    assert ("Which region is the country whose capital is Paris in?", "Europe") in {(q.question, q.answer) for q in two}
    with pytest.raises(ValueError, match="only 716 can be made"):
        qa_pairs(triples, 10_000, hops=2)


def test_store_reopens_and_rejects_foreign_files(db_path, tmp_path):
    store = KGStore(db_path)
    assert store.size > 10_000 and "country" in store.types
    store.close()
    other = tmp_path / "x.sqlite"
    other.write_bytes(b"not sqlite")
    with pytest.raises(ValueError, match="not a countries-kg-1 knowledge graph"):
        KGStore(other)


# --- the HTTP API ---


async def test_known_facts_over_http(url, http):
    status, body = await get(http, url, "/follow", entity="France", relation="capital")
    assert status == 200 and body["objects"] == [{"name": "Paris", "type": "city"}]
    assert body["message"] == "France capital: Paris [city]"
    status, body = await get(http, url, "/follow", entity="germany", relation="borders")
    assert status == 200 and "France" in [o["name"] for o in body["objects"]] and body["total"] == 9
    status, body = await get(http, url, "/follow", entity="Paris", relation="capital of")
    assert body["objects"] == [{"name": "France", "type": "country"}]
    status, body = await get(http, url, "/relations", entity="France")
    counts = {r["relation"]: r["count"] for r in body["relations"]}
    assert status == 200 and counts["capital"] == 1 and counts["borders"] == 9 and counts["province"] == 22
    status, body = await get(http, url, "/entities", name="Fran", type="country")
    assert status == 200 and body["entities"][0]["name"] == "France"
    assert all("country" in e["types"] for e in body["entities"])
    async with http.post(url + "/follow", json={"entity": "USA", "relation": "capital"}) as resp:  # alias, POST
        assert resp.status == 200 and (await resp.json())["objects"][0]["name"] == "Washington D.C."


async def test_unknown_entity_suggests_close_names(url, http):
    status, body = await get(http, url, "/relations", entity="Frnace")
    assert status == 404 and body["suggestions"][0] == "France"
    assert body["error"].startswith("No entity named 'Frnace'. Closest names: France [country]")
    status, body = await get(http, url, "/entities", name="Germny")
    assert status == 200 and body["entities"][0]["name"] == "Germany" and "closest names" in body["message"]
    assert body["matched"] is False  # close names are not a match
    status, body = await get(http, url, "/entities", name="Germa")
    assert body["matched"] is True and "Germany" in [e["name"] for e in body["entities"]]
    status, body = await get(http, url, "/entities", name="qqxqqz")
    assert status == 200 and body["entities"] == [] and "none is close" in body["message"]
    assert "Entity types: city, country" in body["message"]
    status, body = await get(http, url, "/entities", name="Paris", type="country")
    assert body["entities"] == [] and "but these do: Paris [city]" in body["message"]


async def test_unknown_relation_lists_the_relations_the_entity_has(url, http):
    status, body = await get(http, url, "/follow", entity="France", relation="capitol")
    assert status == 404 and "(closest: capital)" in body["error"] and "borders (9)" in body["error"]
    assert "capital" in body["relations"] and "province" in body["relations"]
    status, body = await get(http, url, "/follow", entity="France", relation="languages")  # plural is forgiven
    assert status == 200 and body["relation"] == "language" and body["objects"][0]["name"] == "French"


@pytest.mark.parametrize(
    "method, path, payload, status, error",
    [
        ("GET", "/follow?entity=France", None, 400, "missing parameter 'relation'"),
        ("GET", "/entities", None, 400, "missing parameter 'name'"),
        ("GET", "/follow?entity=France&relation=capital&limit=abc", None, 400, "'limit' must be int"),
        ("GET", "/follow?entity=France&relation=capital&limit=0", None, 400, "must be from 1 to 500"),
        ("GET", "/relations?entity=France&relation=x", None, 400, "unknown parameter 'relation'"),
        ("GET", "/entities?name=a&type=nation", None, 400, "unknown entity type 'nation'"),
        ("GET", "/entities?name=%22*%22", None, 400, "has no letters or digits"),
        ("GET", "/nowhere", None, 404, "unknown endpoint /nowhere; endpoints: /entities"),
        ("DELETE", "/follow", None, 405, "method DELETE not allowed"),
        ("POST", "/follow", {"entity": 5, "relation": "capital"}, 400, "'entity' must be str, got 5"),
        ("POST", "/entities", {"name": "Fr", "limit": True}, 400, "'limit' must be int"),
        ("POST", "/relations", ["France"], 400, "must be a JSON object, got list"),
        ("POST", "/relations", "{not json", 400, "not valid JSON"),
        ("POST", "/relations", {"entity": "x" * 300}, 400, "longer than 200 characters"),
    ],
)
async def test_malformed_requests_get_4xx_json(url, http, method, path, payload, status, error):
    body_args = {"data": payload} if isinstance(payload, str) else {"json": payload} if payload is not None else {}
    async with http.request(method, url + path, **body_args) as resp:
        assert resp.status == status and resp.content_type == "application/json"
        assert error in (await resp.json())["error"]


async def test_holds_1000_concurrent_requests(url):
    cases = [("/follow", {"entity": "France", "relation": "capital"}, "Paris"),
             ("/relations", {"entity": "Germany"}, "borders (9)"),
             ("/entities", {"name": "Fran"}, "France [country]"),
             ("/relations", {"entity": "Frnace"}, "Closest names: France")]  # the slow fuzzy path too

    async def one(session, i):
        path, params, expect = cases[i % len(cases)]
        async with session.get(url + path, params=params) as resp:
            body = await resp.json()
            return expect in body.get("message", body.get("error", ""))

    connector = aiohttp.TCPConnector(limit=100)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=20)) as session:
        start = time.perf_counter()
        async with asyncio.timeout(30):
            results = await asyncio.gather(*(one(session, i) for i in range(1000)))
        print(f"\n1000 requests: {time.perf_counter() - start:.2f} s")
    assert all(results) and len(results) == 1000


# --- the client tool ---


async def test_client_tools_read_the_graph(url):
    async with KGClient(url, timeout_s=5) as kg:
        tools = {t.name: t for t in kg.tools()}
        assert set(tools) == {"search_entities", "get_relations", "follow"}
        assert tools["follow"].schema["function"]["parameters"]["required"] == ["entity", "relation"]
        result = await tools["follow"].call({"entity": "France", "relation": "capital"})
        assert result.ok and result.content == "France capital: Paris [city]"
        result = await tools["follow"].call({"entity": "Germany", "relation": "borders"})
        assert result.ok and "France [country]" in result.content
        result = await tools["get_relations"].call({"entity": "Paris"})
        assert result.ok and "capital_of (1)" in result.content
        result = await tools["search_entities"].call({"name": "Buenos", "entity_type": "city"})
        assert result.ok and result.content.startswith("1 city entity matches 'Buenos':\n- Buenos Aires [city, prov")
        result = await tools["follow"].call({"entity": "Frnace", "relation": "capital"})
        assert not result.ok and "Closest names: France [country]" in result.content
        result = await tools["follow"].call({"entity": "France", "relation": "mayor"})
        assert not result.ok and "Its relations are: alt_name" in result.content


async def test_bare_mode_answers_empty_lookups_with_a_bare_list(url):
    """The collapse study's switch: empty lookups give `[]` (a successful call), found ones read the same."""
    async with KGClient(url, timeout_s=5) as explain, KGClient(url, timeout_s=5, empty_results="bare") as bare:
        ex, ba = ({t.name: t for t in c.tools()} for c in (explain, bare))
        empty = [("follow", {"entity": "Frnace", "relation": "capital"}),  # no such entity (close names exist)
                 ("follow", {"entity": "France", "relation": "mayor"}),  # no such relation
                 ("get_relations", {"entity": "qqxqqz"}),  # no such entity, nothing close
                 ("search_entities", {"name": "Germny"}),  # only close names
                 ("search_entities", {"name": "qqxqqz"}),  # nothing at all
                 ("search_entities", {"name": "Paris", "entity_type": "country"})]  # the name, not the type
        for name, args in empty:
            said, got = await ex[name].call(args), await ba[name].call(args)
            assert got.ok and got.content == "[]", (name, args, got)
            assert said.content != "[]" and len(said.content) > 30  # today's explanation
        found = [("follow", {"entity": "France", "relation": "capital"}), ("get_relations", {"entity": "Paris"}),
                 ("search_entities", {"name": "Buenos", "entity_type": "city"})]
        for name, args in found:
            said, got = await ex[name].call(args), await ba[name].call(args)
            assert said.ok and got.ok and said.content == got.content and got.content != "[]"
        for c in (ex, ba):  # a bad request is not an empty lookup: an error in both modes
            result = await c["search_entities"].call({"name": "Fr", "entity_type": "nation"})
            assert not result.ok and "unknown entity type 'nation'" in result.content
    with pytest.raises(ValueError, match="empty_results must be one of explain, bare"):
        KGClient(url, empty_results="none")


async def test_client_turns_connection_errors_into_tool_errors():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with KGClient(f"http://127.0.0.1:{port}", timeout_s=3) as kg:
        result = await kg.tools()[1].call({"entity": "France"})
    assert not result.ok and f"knowledge graph at http://127.0.0.1:{port} is unreachable" in result.content


async def test_client_gives_up_on_a_silent_service():
    writers: list[asyncio.StreamWriter] = []
    silent = await asyncio.start_server(lambda _, w: writers.append(w), "127.0.0.1", 0)  # accepts, never answers
    port = silent.sockets[0].getsockname()[1]
    try:
        async with KGClient(f"http://127.0.0.1:{port}", timeout_s=0.3) as kg:
            result = await kg.tools()[2].call({"entity": "France", "relation": "capital"})
    finally:
        for writer in writers:
            writer.close()
        silent.close()
        await asyncio.wait_for(silent.wait_closed(), 5)
    assert not result.ok and "did not answer within 0.3 s" in result.content


# --- the CLI ---


def test_kg_serve_cli_reports_a_busy_port(db_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert kg_serve_cli("127.0.0.1", s.getsockname()[1], str(db_path)) == 2
    assert capsys.readouterr().err.startswith("error: ")


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
async def test_kg_serve_cli_serves_until_stopped(db_path, stop):
    code = ("from agent_rl.tools.kg_service import kg_serve_cli as s; "
            f"raise SystemExit(s('127.0.0.1', 0, {str(db_path)!r}))")
    # Ctrl-C's default action, whatever this test process inherited: started as a background job of
    # a script, pytest (and so the child) has SIGINT ignored, and Python then never raises on it
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, stderr=asyncio.subprocess.PIPE,
                                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line = (await asyncio.wait_for(proc.stderr.readline(), 20)).decode()
        served = line.split()[3]  # "knowledge graph at http://127.0.0.1:PORT (Ctrl-C to stop)"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            status, body = await get(http, served, "/follow", entity="Japan", relation="capital")
        assert status == 200 and body["objects"][0]["name"] == "Tokyo"
        proc.send_signal(stop)
        try:
            code = await asyncio.wait_for(proc.wait(), 20)
        except TimeoutError:  # say what the service was doing (one such failure in a full-suite run)
            proc.kill()
            err = await asyncio.wait_for(proc.stderr.read(), 10)
            pytest.fail(f"kg serve still running 20 s after {stop.name}; its stderr: {err.decode()[-3000:]}")
        assert code == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await asyncio.wait_for(proc.wait(), 10)
