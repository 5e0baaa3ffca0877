"""`agent-rl view RUN`: one self-contained HTML page to browse a run's rollout traces, or an evaluation's replies.

Owns: gathering the traces (`runs.traces`) and each traced step's headline metrics (`runs.runlog`)
into the page's data, or an evaluation's replies (`runs.replies`: a "step" per policy, each episode with its
verdict), embedding it safely in `trace_page.html` (beside this module: the page's
markup, style and script), `parse_steps` for `--steps`, and writing the page.
Does not own: what a trace holds or which trajectories are traced (`runs.traces`), the training loop, what an
evaluation keeps (`runs.replies`).

The page works offline from a file: inline CSS and JavaScript, no network, the data embedded as
JSON in a `<script type="application/json">` element with `<`, `>` and `&` escaped, so model
text such as `</script><script>...` cannot end that element; the script puts every text into the
page as text (`textContent`), never as markup. The raw token ids and log-probs stay in the trace
files: the page carries each trajectory's rendered text runs, which is what a reader looks at.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any

from agent_rl.core.files import write_text
from agent_rl.runs.replies import read_replies
from agent_rl.runs.runlog import RunLogError, read_metrics
from agent_rl.runs.traces import read_traces

PAGE_FILE = "traces.html"
TEMPLATE = Path(__file__).with_name("trace_page.html")
# a traced step's headline numbers in the step list and header (those metrics.jsonl has)
STEP_METRICS = ("reward_mean", "reward_std", "tool_use_rate", "tool_failure_rate", "truncation_rate",
                "infra_error_rate", "zero_variance_group_share", "kept_trajectories", "loss", "kl", "entropy")


def parse_steps(spec: str | None) -> set[int] | None:
    """`"1-3,7"` -> {1, 2, 3, 7}; None or "" -> None (every traced step). ValueError names the bad part."""
    if not spec:
        return None
    steps: set[int] = set()
    for part in spec.split(","):
        a, dash, b = part.strip().partition("-")
        try:
            first, last = int(a), int(b) if dash else int(a)
        except ValueError:
            raise ValueError(f"--steps: {part.strip()!r} is not a step or a range like 3-7 (in {spec!r})") from None
        if first < 1 or last < first:
            raise ValueError(f"--steps: {part.strip()!r} is not a range of steps >= 1 (in {spec!r})")
        steps.update(range(first, last + 1))
    return steps


def _for_page(record: dict[str, Any]) -> dict[str, Any]:
    """A trace record without its per-token arrays (the runs' text says what the page shows)."""
    return {**record, "segments": [{"runs": s["runs"]} for s in record.get("segments", [])]}


def page_data(run_dir: str | Path, steps: set[int] | None = None) -> dict[str, Any]:
    """The page's data: a run directory's traced steps, or (a file) an evaluation's replies, a step per policy."""
    if Path(run_dir).is_file():
        policies = [s for s in read_replies(run_dir) if steps is None or s["step"] in steps]
        return {"run": Path(run_dir).name, "run_dir": str(run_dir), "steps": policies}
    traces = read_traces(run_dir, steps)
    try:
        metrics = {r["step"]: r for r in read_metrics(run_dir)}
    except RunLogError:  # traces without metrics (a run killed in its first step): show them anyway
        metrics = {}
    return {"run": Path(run_dir).resolve().name, "run_dir": str(run_dir),
            "steps": [{"step": s,
                       "metrics": {k: metrics[s][k] for k in STEP_METRICS if metrics.get(s, {}).get(k) is not None},
                       "trajectories": [_for_page(r) for r in records]}
                      for s, records in sorted(traces.items())]}


def embed_json(data: Any) -> str:
    """JSON safe inside a `<script>` element: no `<`, `>` or `&` survives to the HTML parser."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False)
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def build_page(run_dir: str | Path, steps: set[int] | None = None) -> str:
    data = page_data(run_dir, steps)
    values = {"TITLE": html.escape(f"traces: {data['run']}"), "DATA": embed_json(data)}
    # one pass: a placeholder's name inside the data (model text) is never replaced
    return re.sub(r"__(TITLE|DATA)__", lambda m: values[m.group(1)], TEMPLATE.read_text(encoding="utf-8"))


def write_page(run_dir: str | Path, out: str | Path | None = None, steps: set[int] | None = None) -> Path:
    """Write the page (default `<run_dir>/traces.html`, or beside a replies file `X.replies.jsonl`:
    `X.replies.html`) and return its path."""
    page = build_page(run_dir, steps)
    default = Path(run_dir).with_suffix(".html") if Path(run_dir).is_file() else Path(run_dir) / PAGE_FILE
    return write_text(Path(out) if out else default, page)
