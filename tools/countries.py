"""Country facts from the offline `countryinfo` package, as triples, articles and quiz questions.

Owns: reading countryinfo's JSON files (freshly on every call: no cache, sorted, deterministic),
normalising names (`clean_name`, `entity_key`), the fact triples (`country_triples`, plus their
inverse edges through `inverse_triples`), one plain-text article per country (`country_articles`)
and a seedable generator of one- and two-hop question/answer pairs (`qa_pairs`).
Does not own: storing or serving any of it (the search index lives in `tools.search`, the
knowledge-graph database and HTTP API in `tools.kg_service`).

Only countryinfo's `data/` folder is read: `data_no_iso/` holds unnamed territories and duplicates
(Burma next to Myanmar). Entities are keyed by name; one name may carry several types
("Luxembourg" is a country, a city and a Belgian province). Literal objects (numbers, text) are
not entities and get no inverse edge.
"""

from __future__ import annotations

import json
import random
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

# relation -> type of its objects; "number" and "text" are literals, the rest are entities
RELATIONS: dict[str, str] = {
    "capital": "city",
    "region": "region",
    "subregion": "subregion",
    "intermediate_region": "subregion",
    "borders": "country",
    "language": "language",
    "currency": "currency",
    "province": "province",
    "population": "number",
    "area_km2": "number",
    "demonym": "text",
    "calling_code": "text",
    "top_level_domain": "text",
    "alt_name": "text",
}
LITERAL_TYPES = frozenset({"number", "text"})
SYMMETRIC = frozenset({"borders"})
INVERSE_SUFFIX = "_of"  # Paris capital_of France; Europe region_of France

# ISO 639 codes used by countryinfo -> English names ("rs" is countryinfo's typo for Serbian)
_LANGUAGES = dict(pair.split("=") for pair in """
af=Afrikaans am=Amharic ar=Arabic ay=Aymara az=Azerbaijani be=Belarusian bg=Bulgarian bi=Bislama
bn=Bengali bs=Bosnian ca=Catalan ch=Chamorro cnr=Montenegrin cs=Czech da=Danish de=German
dv=Divehi dz=Dzongkha el=Greek en=English es=Spanish et=Estonian fa=Persian ff=Fula fi=Finnish
fj=Fijian fo=Faroese fr=French ga=Irish gn=Guarani gv=Manx he=Hebrew hi=Hindi hr=Croatian
ht=Haitian_Creole hu=Hungarian hy=Armenian id=Indonesian is=Icelandic it=Italian ja=Japanese
ka=Georgian kg=Kongo kk=Kazakh kl=Greenlandic km=Khmer ko=Korean ku=Kurdish ky=Kyrgyz la=Latin
lb=Luxembourgish ln=Lingala lo=Lao lt=Lithuanian lu=Luba-Katanga lv=Latvian mg=Malagasy
mh=Marshallese mi=Maori mk=Macedonian mn=Mongolian ms=Malay mt=Maltese my=Burmese na=Nauruan
nb=Norwegian_Bokmål nd=North_Ndebele ne=Nepali nl=Dutch nn=Norwegian_Nynorsk no=Norwegian
nr=South_Ndebele ny=Chichewa oc=Occitan pa=Punjabi pl=Polish ps=Pashto pt=Portuguese qu=Quechua
rn=Kirundi ro=Romanian rs=Serbian ru=Russian rw=Kinyarwanda sg=Sango si=Sinhala sk=Slovak
sl=Slovenian sm=Samoan sn=Shona so=Somali sq=Albanian sr=Serbian ss=Swati st=Sotho sv=Swedish
sw=Swahili ta=Tamil tg=Tajik th=Thai ti=Tigrinya tk=Turkmen tn=Tswana to=Tongan tr=Turkish
ts=Tsonga uk=Ukrainian ur=Urdu uz=Uzbek ve=Venda vi=Vietnamese xh=Xhosa zh=Chinese zu=Zulu
""".split())
_LANGUAGES = {code: name.replace("_", " ") for code, name in _LANGUAGES.items()}


class Triple(NamedTuple):
    subject: str
    relation: str
    object: str
    subject_type: str
    object_type: str


class Article(NamedTuple):
    title: str
    text: str


def clean_name(value: object) -> str:
    """Display form of a name: NFC, single spaces, no surrounding blanks."""
    return " ".join(unicodedata.normalize("NFC", str(value)).split())


def entity_key(name: str) -> str:
    """Lookup form of a name: no accents, case-folded, punctuation as spaces ("Côte d'Ivoire" -> "cote d ivoire")."""
    plain = "".join(c for c in unicodedata.normalize("NFKD", name) if not unicodedata.combining(c))
    return " ".join(re.sub(r"[\W_]+", " ", plain.casefold()).split())


def _data_dir() -> Path:
    import countryinfo  # the data extra; imported here so the module loads without it

    return Path(countryinfo.__file__).parent / "data"


def load_countries() -> list[dict]:
    """Raw countryinfo records with a name, one per country name, sorted by name."""
    records: dict[str, dict] = {}
    for path in sorted(_data_dir().glob("*.json")):
        record = json.loads(path.read_text(encoding="utf-8"))
        name = clean_name(record.get("name") or "")
        if name and name not in records:  # Curaçao ships twice
            records[name] = record
    if not records:
        raise RuntimeError(f"no country files found under {_data_dir()}")
    return [records[n] for n in sorted(records)]


def _facts(record: dict, by_code: dict[str, str]) -> list[tuple[str, str]]:
    """(relation, object) pairs of one country record, in RELATIONS order."""
    iso = record.get("ISO") or {}
    capitals = record.get("capital") or []
    capitals = capitals if isinstance(capitals, list) else str(capitals).split(" / ")
    values = {
        "capital": capitals,
        "region": [record.get("region")],
        "subregion": [record.get("subregion")],
        "intermediate_region": [record.get("intermediateregion")],
        "borders": [by_code.get(str(code).upper()) for code in record.get("borders") or []],
        "language": [_LANGUAGES.get(code, code) for code in record.get("languages") or []],
        "currency": record.get("currencies") or [],
        "province": record.get("provinces") or [],
        "population": [record.get("population")],
        "area_km2": [record.get("area")],
        "demonym": [record.get("demonym")],
        "calling_code": record.get("callingCodes") or [],
        "top_level_domain": record.get("tld") or [],
        "alt_name": [s for s in record.get("altSpellings") or [] if s != iso.get("alpha2")],
    }
    pairs: list[tuple[str, str]] = []
    for relation, objects in values.items():
        for obj in objects:
            if isinstance(obj, float) and obj.is_integer():
                obj = int(obj)
            text = clean_name(obj) if obj is not None else ""
            if text and (relation, text) not in pairs:
                pairs.append((relation, text))
    return pairs


def country_triples(inverse: bool = False) -> list[Triple]:
    """All country facts as sorted triples; `borders` is closed under symmetry.

    Args:
        inverse: also add the `<relation>_of` edges from entity objects back to their subjects.
    """
    records = load_countries()
    by_code: dict[str, str] = {}
    for record in records:  # alpha-3 first, alpha-2 as a fallback for typos like "IT"
        iso = record.get("ISO") or {}
        for field in ("alpha2", "alpha3"):
            if iso.get(field):
                by_code[str(iso[field]).upper()] = clean_name(record["name"])
    facts: set[Triple] = set()
    for record in records:
        name = clean_name(record["name"])
        for relation, obj in _facts(record, by_code):
            facts.add(Triple(name, relation, obj, "country", RELATIONS[relation]))
            if relation in SYMMETRIC:
                facts.add(Triple(obj, relation, name, "country", "country"))
    forward = sorted(facts)
    return sorted(forward + inverse_triples(forward)) if inverse else forward


def inverse_triples(triples: list[Triple]) -> list[Triple]:
    """The reverse edge of every triple whose object is an entity (symmetric relations excluded)."""
    return [
        Triple(t.object, t.relation + INVERSE_SUFFIX, t.subject, t.object_type, t.subject_type)
        for t in triples
        if t.object_type not in LITERAL_TYPES and t.relation not in SYMMETRIC
    ]


def country_articles() -> list[Article]:
    """One encyclopedia-style article per country, written from its facts, sorted by title."""
    by_subject: dict[str, dict[str, list[str]]] = {}
    for t in country_triples():
        by_subject.setdefault(t.subject, {}).setdefault(t.relation, []).append(t.object)
    articles = []
    for name, f in sorted(by_subject.items()):
        get = lambda rel, f=f: ", ".join(f.get(rel, []))  # noqa: E731
        where = ", ".join(x for x in (get("intermediate_region"), get("subregion"), get("region")) if x)
        lines = [f"{name} is a country" + (f" in {where}." if where else ".")]
        if "alt_name" in f:
            lines.append(f"It is also known as {get('alt_name')}.")
        if "capital" in f:
            lines.append(f"Its capital is {get('capital')}.")
        lines.append(f"It borders {get('borders')}." if "borders" in f else "It has no land borders.")
        for rel, label in (("language", "Languages"), ("currency", "Currency"), ("demonym", "Demonym"),
                           ("population", "Population"), ("area_km2", "Area in square kilometres"),
                           ("calling_code", "Calling code"), ("top_level_domain", "Internet domain"),
                           ("province", "Provinces and regions")):
            if rel in f:
                lines.append(f"{label}: {get(rel)}.")
        articles.append(Article(name, " ".join(lines)))
    return articles


@dataclass(frozen=True)
class QA:
    question: str
    answer: str
    hops: int
    triples: tuple[Triple, ...]  # the facts that support the answer, in reasoning order


def qa_pairs(triples: list[Triple], n: int, seed: int = 0, hops: int | None = None) -> list[QA]:
    """`n` distinct question/answer pairs drawn with `seed`; every answer is unique in `triples`.

    Args:
        triples: forward facts, as from `country_triples()`.
        n: how many pairs to return.
        seed: the random seed; the same seed and triples give the same pairs.
        hops: 1 or 2 for only single- or two-hop questions; None for both.
    """
    if hops not in (None, 1, 2):
        raise ValueError(f"hops must be 1, 2 or None, got {hops!r}")
    out: dict[tuple[str, str], list[Triple]] = {}  # (subject, relation) -> facts
    back: dict[tuple[str, str], list[Triple]] = {}  # (object, relation) -> facts
    for t in triples:
        if t.subject_type == "country":
            out.setdefault((t.subject, t.relation), []).append(t)
            back.setdefault((t.object, t.relation), []).append(t)

    def one(key: tuple[str, str], index: dict) -> Triple | None:
        found = index.get(key, [])
        return found[0] if len(found) == 1 else None

    single = {"capital": "What is the capital of {}?", "region": "Which region is {} in?",
              "subregion": "Which subregion is {} in?", "currency": "What currency is used in {}?"}
    via_capital = {"region": "Which region is the country whose capital is {} in?",
                   "subregion": "Which subregion is the country whose capital is {} in?",
                   "currency": "What currency is used in the country whose capital is {}?"}
    candidates: list[QA] = []
    for country in sorted({t.subject for t in triples if t.subject_type == "country"}):
        for rel, template in single.items():
            if (fact := one((country, rel), out)):
                candidates.append(QA(template.format(country), fact.object, 1, (fact,)))
        capital = one((country, "capital"), out)
        if capital and one((capital.object, "capital"), back):  # the capital names this country only
            for rel, template in via_capital.items():
                if (fact := one((country, rel), out)):
                    candidates.append(QA(template.format(capital.object), fact.object, 2, (capital, fact)))
        neighbour = one((country, "borders"), out)
        if neighbour and (capital := one((neighbour.object, "capital"), out)):
            question = f"What is the capital of the only country that borders {country}?"
            candidates.append(QA(question, capital.object, 2, (neighbour, capital)))
    candidates = [qa for qa in candidates if hops is None or qa.hops == hops]
    if not 0 <= n <= len(candidates):
        raise ValueError(f"asked for {n} questions but only {len(candidates)} can be made (hops={hops})")
    return random.Random(seed).sample(candidates, n)
