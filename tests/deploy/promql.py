"""What the Prometheus/Grafana tests share: the PromQL the rules and the dashboard hold, the metric names
the daemons define, and a small client for Prometheus' HTTP API.

Metric names are pulled out of PromQL lexically (strings, label matchers, ranges and grouping label
lists removed; what is left that looks like an identifier and is not a function, keyword or number is
a metric name). That is enough for the expressions we write; Prometheus itself (``promtool check
rules``, the query API) is what decides whether they parse.
"""

from __future__ import annotations

import ast
import functools
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from tests.deploy.tools import DEPLOY, REPO

PROMETHEUS_DIR = DEPLOY / "prometheus"
RULE_FILES = (PROMETHEUS_DIR / "rules" / "pdserve-recording.yml", PROMETHEUS_DIR / "rules" / "pdserve-alerts.yml")
RULE_TESTS = tuple(sorted((PROMETHEUS_DIR / "tests").glob("*.test.yml")))
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "pdserve.json"

# Series Prometheus makes itself (per target), not the daemons.
PROMETHEUS_SERIES = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped",
                               "scrape_samples_post_metric_relabeling", "scrape_series_added", "ALERTS",
                               "ALERTS_FOR_STATE"})

_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
# An identifier not glued to a digit, dot or another identifier (so the `e9` of `1e9` is not one).
_IDENT = re.compile(r"(?<![\w.:])[A-Za-z_:][\w:]*")
_KEYWORDS = frozenset({"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
                       "bool", "offset", "inf", "nan", "atan2"})
_GRAFANA_VARIABLE = re.compile(r"\$\{?(\w+)(?::\w+)?\}?")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects."""
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    names = set()
    for m in _IDENT.finditer(text):
        rest = text[m.end():].lstrip()
        if rest.startswith("("):  # a function or an aggregation
            continue
        if m.group(0).lower() not in _KEYWORDS:
            names.add(m.group(0))
    return names


# --- rules ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rule:
    file: str
    group: str
    kind: str  # "record" or "alert"
    name: str
    expr: str
    labels: dict
    annotations: dict


def rules() -> list[Rule]:
    out = []
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for r in group["rules"]:
                kind = "record" if "record" in r else "alert"
                out.append(Rule(path.name, group["name"], kind, r[kind], r["expr"], r.get("labels", {}),
                                r.get("annotations", {})))
    return out


def recording_rule_names() -> set[str]:
    return {r.name for r in rules() if r.kind == "record"}


def alert_names() -> set[str]:
    return {r.name for r in rules() if r.kind == "alert"}


# --- the dashboard -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PanelQuery:
    panel: str
    ref: str
    expr: str

    def instant(self, rate_interval: str = "30s") -> str:
        """The query as Prometheus would get it with every variable at "all"."""
        return substitute(self.expr, rate_interval)


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(panels: list[dict]) -> Iterator[dict]:
    for p in panels:
        yield p
        yield from _panels(p.get("panels", []))  # panels inside a collapsed row


def panels() -> list[dict]:
    return [p for p in _panels(dashboard()["panels"]) if p.get("type") != "row"]


def panel_queries() -> list[PanelQuery]:
    return [PanelQuery(p["title"], t["refId"], t["expr"]) for p in panels() for t in p.get("targets", [])]


def variable_queries() -> dict[str, str]:
    """Each query variable's query, e.g. ``{"model": "label_values(pdserve_worker_info, model)"}``."""
    out = {}
    for v in dashboard()["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]
            out[v["name"]] = q["query"] if isinstance(q, dict) else q
    return out


_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(.*),\s*(\w+)\s*\)\s*$", re.S)


def label_values_query(query: str) -> tuple[str, str]:
    """``label_values(SELECTOR, LABEL)`` -> (SELECTOR, LABEL)."""
    m = _LABEL_VALUES.match(query)
    if not m:
        raise ValueError(f"not a label_values(selector, label) query: {query}")
    return m.group(1), m.group(2)


def substitute(expr: str, rate_interval: str = "30s") -> str:
    """Grafana's variables at their "all" values: regex ones match anything, intervals are fixed."""
    def value(m: re.Match) -> str:
        name = m.group(1)
        if name in ("__rate_interval", "__interval", "__range"):
            return rate_interval
        return ".*"

    return _GRAFANA_VARIABLE.sub(value, expr)


def dashboard_exprs() -> list[str]:
    """Every PromQL expression the dashboard runs: panel targets and variable selectors."""
    exprs = [q.instant() for q in panel_queries()]
    exprs += [substitute(label_values_query(q)[0]) for q in variable_queries().values()]
    return exprs


# --- what the daemons define ---------------------------------------------------------------------------

_CLIENT_KINDS = {
    "Counter": "counter", "CounterMetricFamily": "counter",
    "Gauge": "gauge", "GaugeMetricFamily": "gauge",
    "Histogram": "histogram", "HistogramMetricFamily": "histogram",
    "Summary": "summary", "SummaryMetricFamily": "summary",
    "Info": "info", "InfoMetricFamily": "info",
    "Enum": "gauge", "StateSetMetricFamily": "gauge",
}


def _exposed(kind: str, name: str) -> set[str]:
    """The sample names prometheus_client exposes for a metric of this kind and name."""
    if kind == "counter":
        base = name.removesuffix("_total")
        return {f"{base}_total", f"{base}_created"}
    if kind == "histogram":
        return {f"{name}_bucket", f"{name}_count", f"{name}_sum", f"{name}_created"}
    if kind == "summary":
        return {name, f"{name}_count", f"{name}_sum", f"{name}_created"}
    if kind == "info":
        return {f"{name.removesuffix('_info')}_info"}
    return {name}


@functools.cache
def defined_metrics(root: Path = REPO / "services") -> dict[str, frozenset[str]]:
    """Every metric the daemons define (prometheus_client metrics and custom collectors' families,
    found in the source), by family name, each with the sample names it exposes."""
    families: dict[str, frozenset[str]] = {}
    for path in sorted(root.rglob("*.py")):
        if "proto_gen" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if func not in _CLIENT_KINDS:
                continue
            first = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "name"), None)
            if isinstance(first, ast.Constant) and isinstance(first.value, str) and first.value.startswith("pdserve_"):
                families[first.value] = frozenset(_exposed(_CLIENT_KINDS[func], first.value))
    return families


def defined_metric_names() -> set[str]:
    return set().union(*defined_metrics().values())


# --- Prometheus' HTTP API ------------------------------------------------------------------------------

class PromQLError(AssertionError):
    pass


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=10)

    def close(self) -> None:
        self.http.close()

    def ready(self) -> bool:
        try:
            return self.http.get("/-/ready").status_code == 200
        except httpx.HTTPError:
            return False

    def _get(self, path: str, **params) -> object:
        response = self.http.get(path, params=params)
        body = response.json()
        if body.get("status") != "success":
            raise PromQLError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """An instant query's result (a vector, or a one-element list for a scalar)."""
        data = self._get("/api/v1/query", query=expr)
        return data["result"] if data["resultType"] in ("vector", "matrix") else [{"value": data["result"]}]

    def value(self, expr: str) -> float:
        """The single value ``expr`` returns (0 when it returns nothing)."""
        result = self.query(expr)
        assert len(result) <= 1, f"{expr}: {len(result)} series"
        return float(result[0]["value"][1]) if result else 0.0

    def metric_names(self) -> set[str]:
        return set(self._get("/api/v1/label/__name__/values"))

    def rule_groups(self) -> list[dict]:
        return self._get("/api/v1/rules")["groups"]

    def alerts(self) -> list[dict]:
        return self._get("/api/v1/alerts")["alerts"]

    def active_targets(self) -> list[dict]:
        return self._get("/api/v1/targets", state="active")["activeTargets"]

    def wait(self, predicate, what: str, timeout_s: float = 30.0, every_s: float = 0.5):
        """Poll until ``predicate()`` is truthy and return it; fail with ``what`` after the timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = predicate()
            if got:
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"Prometheus: gave up after {timeout_s:g} s waiting for {what}")
            time.sleep(every_s)
