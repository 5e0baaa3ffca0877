"""Short factual answers: extract the model's final answer and judge it against the accepted names.

Owns: `normalize` (the comparison form of a name), `final_answer` (the span that is judged),
`mentions` (which known names a text states) and `judge_answer` -> `Verdict`.
Does not own: where the accepted names and the candidate vocabulary come from (the environment
passes them in) or numbers (`rewards.answers`; no country question has a numeric answer).

The rule: the answer is correct when it names an accepted form of the reference and no other
candidate, where candidates are all names the answer could have been (e.g. every capital city of
the graph for a capital question). Listing several capitals to catch the right one earns nothing;
a sentence around the right name ("The capital of France is Paris.") is fine. A name inside a
longer stated name does not count on its own: "Latin America and the Caribbean" does not also
state "Caribbean". And an answer is a name or a sentence that states it, not a passage: a span of
more than `MAX_ANSWER_WORDS` words (the longest name in the graph has 10) earns nothing, or a copied
article or page of search results, which names the answer among the rest, would earn the reward
without the answer ever being picked out of it.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from agent_rl.core.renderers.toolcalls import parse_bare_calls

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_TOOL_CALL = re.compile(r"<tool_call>.*?(</tool_call>|$)", re.DOTALL)
MAX_ANSWER_WORDS = 20
_LEAD_IN = re.compile(r"^(?:so |thus )?(?:final )?(?:answer(?: is)?|it is|its)\s+")  # on normalised text


def normalize(text: str) -> str:
    """Comparison form: no accents or case, apostrophes dropped, other punctuation as spaces,
    no "the", "st" read as "saint", single letters joined ("Washington, D.C." == "washington dc")."""
    plain = "".join(c for c in unicodedata.normalize("NFKD", text) if not unicodedata.combining(c)).casefold()
    plain = re.sub(r"['’`]", "", plain.replace("&", " and "))
    words = ["saint" if w == "st" else w for w in re.findall(r"[^\W_]+", plain) if w != "the"]
    joined: list[str] = []
    in_letters = False  # inside a run of single letters, joined into one word
    for w in words:
        single = len(w) == 1 and w.isalpha()
        if single and in_letters:
            joined[-1] += w
        else:
            joined.append(w)
        in_letters = single
    return " ".join(joined)


def final_answer(text: str) -> str:
    """The judged span: the <answer>...</answer> if any, else the text without tool calls. "" for a reply
    of bare JSON calls (a call, not an answer) and for several answer tags: a flood of tagged candidates
    cut by the token budget would otherwise be judged on whichever tag the cut left last."""
    tagged = _ANSWER_TAG.findall(text)
    if parse_bare_calls(text) or len(tagged) > 1:  # a call, or answers spread over several tags
        return ""
    return (tagged[-1] if tagged else _TOOL_CALL.sub(" ", text)).strip()


def mentions(text: str, names: Iterable[str]) -> set[str]:
    """The normalised `names` stated in `text` as whole words, minus those only inside a longer match."""
    words = normalize(text).split()
    spans: list[tuple[int, int, str]] = []
    for name in {normalize(n) for n in names} - {""}:
        target = name.split()
        spans += [(i, i + len(target), name) for i in range(len(words) - len(target) + 1)
                  if words[i : i + len(target)] == target]
    inside = lambda s: any(o[0] <= s[0] and s[1] <= o[1] and o[1] - o[0] > s[1] - s[0] for o in spans)  # noqa: E731
    return {s[2] for s in spans if not inside(s)}


@dataclass(frozen=True)
class Verdict:
    named: bool  # the span names an accepted form
    others: tuple[str, ...]  # the other candidates it names (normalised)
    exact: bool  # the whole span (after a lead-in such as "The answer is") is an accepted form
    passage: bool = False  # the span is longer than an answer (MAX_ANSWER_WORDS)

    @property
    def correct(self) -> bool:
        return self.named and not self.others and not self.passage

    @property
    def hedged(self) -> bool:
        """Named the right answer among others: what the candidate rule refuses to credit."""
        return self.named and bool(self.others)


def judge_answer(completion: str, accepted: Collection[str], candidates: Collection[str] = ()) -> Verdict:
    """Judge a final message against the accepted names (the reference and its aliases)."""
    span = final_answer(completion)
    want = {normalize(a) for a in accepted} - {""}
    said = mentions(span, [*accepted, *candidates])
    others = tuple(sorted(said - want))
    exact = _LEAD_IN.sub("", normalize(span)) in want
    passage = len(normalize(span).split()) > MAX_ANSWER_WORDS
    return Verdict(named=bool(said & want), others=others, exact=exact, passage=passage)
