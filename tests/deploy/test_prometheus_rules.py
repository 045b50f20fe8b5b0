"""The Prometheus config, rules and Grafana dashboard, checked with promtool and against the daemons' code.

Fast: promtool runs, no pdserve process. ``tests/e2e/test_observability.py`` runs the same rules and
dashboard queries against a real Prometheus scraping a real ``pdserve up``.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy import promql
from tests.deploy.tools import DEPLOY, tool

PROMETHEUS_YML = DEPLOY / "prometheus" / "prometheus.yml"
COMPONENT_JOBS = {"pdserve-router", "pdserve-prefill", "pdserve-decode"}


def _promtool(*args: str) -> str:
    result = subprocess.run([tool("promtool"), *args], capture_output=True, text=True, timeout=60)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"promtool {' '.join(args)} failed:\n{output}"
    return output


# --- prometheus.yml ------------------------------------------------------------------------------------

def test_prometheus_config_is_valid() -> None:
    _promtool("check", "config", str(PROMETHEUS_YML))


def test_prometheus_config_loads_the_rules(tmp_path: Path) -> None:
    # `check config` resolves rule_files and checks each file it matches. The compose path
    # (/etc/prometheus/rules/*.yml, where docker-compose mounts deploy/prometheus/rules/) matches nothing
    # on this machine, so the check above saw no rule file: check a copy whose rule_files points at the
    # repository's rules directory instead, which must find both rule files.
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    assert config["rule_files"] == ["/etc/prometheus/rules/*.yml"]
    config["rule_files"] = [str(promql.RULE_FILES[0].parent / "*.yml")]
    copy = tmp_path / "prometheus.yml"
    copy.write_text(yaml.safe_dump(config))
    output = _promtool("check", "config", str(copy))
    assert "2 rule files found" in output, output
    for path in promql.RULE_FILES:
        assert f"Checking {path}" in output, output


def test_prometheus_config_scrapes_every_replica_of_each_component() -> None:
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    assert config["global"]["scrape_interval"] in ("5s", "10s")
    assert config["global"]["evaluation_interval"] in ("5s", "10s")
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) >= COMPONENT_JOBS
    expected = {"pdserve-router": ("router", 8000), "pdserve-prefill": ("prefill", 9101),
                "pdserve-decode": ("decode", 9102)}
    for name, (service, port) in expected.items():
        (sd,) = jobs[name]["dns_sd_configs"]
        assert (sd["names"], sd["type"], sd["port"]) == ([service], "A", port), name


# --- rule files -------------------------------------------------------------------------------------------

def test_rule_files_pass_promtool_check() -> None:
    output = _promtool("check", "rules", *map(str, promql.RULE_FILES))
    assert output.count("SUCCESS") == len(promql.RULE_FILES), output


@pytest.mark.parametrize("test_file", promql.RULE_TESTS, ids=lambda p: p.name)
def test_rule_unit_tests_pass(test_file: Path) -> None:
    output = _promtool("test", "rules", str(test_file))
    assert "SUCCESS" in output, output


def test_rule_unit_tests_exist() -> None:
    assert {p.name for p in promql.RULE_TESTS} >= {"alerts.test.yml", "recording.test.yml"}


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    firing: set[str] = set()
    quiet: set[str] = set()
    for path in promql.RULE_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    alerts = promql.alert_names()
    assert alerts - firing == set(), "alerts without a firing test case"
    assert alerts - quiet == set(), "alerts without a not-firing test case"


def test_recording_rules_are_evaluated_in_unit_tests() -> None:
    tested = set()
    for path in promql.RULE_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("promql_expr_test", []):
                tested |= promql.metric_names(check["expr"]) & promql.recording_rule_names()
    # Quantiles from a synthetic histogram, both GB/s figures, the ratios the alerts use.
    assert {"role:pdserve_time_to_first_token_seconds:p99_rate1m",
            "job:pdserve_router_time_to_first_token_seconds:p99_rate5m",
            "role:pdserve_kv_transfer_gigabytes:rate1m",
            "role:pdserve_kv_transfer_gigabytes_per_pull_second:ratio_rate1m",
            "role:pdserve_kv_transfer_bytes_per_pull:ratio_rate1m",
            "role:pdserve_kv_transfer_descriptors_per_pull:ratio_rate1m",
            "role:pdserve_kv_pull_failures:ratio_rate5m",
            "role:pdserve_local_recompute_fallbacks:ratio_rate5m",
            "instance:pdserve_kv_blocks_used:ratio"} <= tested


def test_recording_rule_names_follow_level_metric_operations() -> None:
    for name in promql.recording_rule_names():
        assert re.fullmatch(r"[a-z_]+:[a-z0-9_]+:[a-z0-9_]+", name), name


def test_alerts_have_severity_summary_and_description() -> None:
    for rule in promql.rules():
        if rule.kind == "alert":
            assert rule.labels.get("severity") in ("warning", "critical"), rule.name
            assert rule.annotations.get("summary") and rule.annotations.get("description"), rule.name


def test_ttft_slo_is_stated_in_the_rule() -> None:
    (slo,) = [r for r in promql.rules() if r.name == "PdserveTTFTSLOBreach"]
    threshold = re.search(r">\s*([\d.]+)\s*$", slo.expr.strip())
    assert threshold and float(threshold.group(1)) == 2.0, slo.expr
    assert "2 s" in slo.annotations["slo"] and "2 s" in slo.annotations["summary"]


def test_the_alerts_the_deployment_needs_exist() -> None:
    assert promql.alert_names() >= {
        "PdserveNoHealthyPair", "PdserveRouterUnavailable", "PdserveKVPullFailures", "PdserveLocalRecomputes",
        "PdserveKVLeaseExpiries", "PdserveKVBlocksNearlyFull", "PdserveTTFTSLOBreach", "PdserveWorkerRestarts",
        "PdserveTargetDown", "PdserveKVIntegrityFailures"}


def test_alerts_select_the_component_jobs_prometheus_yml_defines() -> None:
    jobs = {job["job_name"] for job in yaml.safe_load(PROMETHEUS_YML.read_text())["scrape_configs"]}
    for rule in promql.rules():
        for name in re.findall(r'job="([^"]+)"', rule.expr):
            assert name in jobs, f"{rule.name} selects job {name}, which prometheus.yml does not define"


# --- metric names: rules and dashboard against what the daemons define --------------------------------

def _mentioned() -> dict[str, set[str]]:
    """Metric name -> where the rules or the dashboard mention it."""
    where: dict[str, set[str]] = {}
    for rule in promql.rules():
        for name in promql.metric_names(rule.expr):
            where.setdefault(name, set()).add(f"rule {rule.name}")
    for q in promql.panel_queries():
        for name in promql.metric_names(q.instant()):
            where.setdefault(name, set()).add(f"panel {q.panel!r}")
    for var, query in promql.variable_queries().items():
        for name in promql.metric_names(promql.substitute(promql.label_values_query(query)[0])):
            where.setdefault(name, set()).add(f"variable {var}")
    return where


def test_every_metric_the_rules_and_dashboard_use_is_defined_by_the_daemons() -> None:
    defined = promql.defined_metric_names()
    # Sanity: the scan finds each daemon's metrics, the supervisor's included.
    assert {"pdserve_requests_total", "pdserve_router_status", "pdserve_up_worker_restarts_total",
            "pdserve_worker_info", "pdserve_kv_transfer_seconds_bucket"} <= defined
    known = defined | promql.recording_rule_names() | promql.PROMETHEUS_SERIES
    unknown = {name: sorted(where) for name, where in _mentioned().items() if name not in known}
    assert not unknown, f"metrics no daemon defines: {unknown}"


def test_every_metric_the_daemons_define_is_on_the_dashboard_or_in_a_rule() -> None:
    mentioned = set(_mentioned())
    unused = sorted(family for family, exposed in promql.defined_metrics().items() if not exposed & mentioned)
    assert not unused, f"metrics neither a panel nor a rule uses: {unused}"


def test_metric_name_extraction() -> None:
    expr = ('sum by (role, le) (rate(pdserve_a_bucket{instance=~"$instance", x="by (y)"}[$__rate_interval]))'
            ' / on (job) group_left(model) pdserve_b * 1e9 + ignoring(q) rec:pdserve_c:ratio offset 5m'
            ' or absent(up{job="j"} == 1) and bool')
    assert promql.metric_names(promql.substitute(expr)) == {"pdserve_a_bucket", "pdserve_b", "rec:pdserve_c:ratio",
                                                             "up"}


# --- the Grafana dashboard --------------------------------------------------------------------------------

def test_dashboard_identity_and_variables() -> None:
    d = promql.dashboard()
    assert d["uid"] == "pdserve" and d["schemaVersion"] == 39
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert promql.variable_queries() == {
        "model": "label_values(pdserve_worker_info, model)",
        "instance": 'label_values(pdserve_worker_info{model=~"$model"}, instance)'}
    assert variables["instance"]["multi"] and variables["instance"]["includeAll"]
    for name in ("model", "instance"):
        assert variables[name]["datasource"]["uid"] == "${datasource}"


def test_dashboard_panels_use_the_datasource_variable_and_rate_interval() -> None:
    panels = promql.panels()
    ids = [p["id"] for p in promql._panels(promql.dashboard()["panels"])]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
            for window in re.findall(r"\b(?:rate|increase|irate)\([^\[]*\[([^\]]+)\]", t["expr"]):
                assert window == "$__rate_interval", f"{p['title']}: {t['expr']}"


def test_dashboard_worker_queries_follow_the_instance_variable() -> None:
    worker_series = {n for family, exposed in promql.defined_metrics().items() for n in exposed
                     if not family.startswith(("pdserve_router_", "pdserve_up_", "pdserve_planner_"))}  # the router's
    worker_series.add("instance:pdserve_kv_blocks_used:ratio")
    for q in promql.panel_queries():
        for name in promql.metric_names(q.expr) & worker_series:
            assert re.search(re.escape(name) + r'\{[^}]*instance=~"\$instance"', q.expr), \
                f"{q.panel!r}: {name} is not filtered by $instance: {q.expr}"


def test_dashboard_has_the_panels_the_deployment_needs() -> None:
    used = set()
    for q in promql.panel_queries():
        used |= promql.metric_names(q.expr)
    assert used >= {
        "pdserve_router_requests_total", "pdserve_requests_total", "pdserve_router_time_to_first_token_seconds_bucket",
        "pdserve_router_inter_token_latency_seconds_bucket", "pdserve_router_e2e_request_latency_seconds_bucket",
        "pdserve_time_to_first_token_seconds_bucket", "pdserve_inter_token_latency_seconds_bucket",
        "pdserve_router_added_latency_seconds_bucket", "pdserve_router_routed_requests_total", "pdserve_queue_depth",
        "pdserve_running_requests", "pdserve_kv_blocks", "pdserve_kv_transfer_bytes_total",
        "pdserve_kv_transfer_descriptors_total", "pdserve_kv_transfer_seconds_bucket",
        "pdserve_kv_handshake_failures_total", "pdserve_kv_transfer_failures_total",
        "pdserve_local_recompute_fallbacks_total", "pdserve_kv_lease_expiries_total",
        "pdserve_up_worker_restarts_total", "pdserve_router_workers", "pdserve_planner_desired_workers",
        "pdserve_planner_decisions_total"}


def test_dashboard_queries_parse(tmp_path: Path) -> None:
    # promtool parses every expression of a rule file: the dashboard's queries (variables at "all")
    # become recording rules of a scratch file, so a typo fails here rather than on a blank panel.
    exprs = promql.dashboard_exprs()
    rules = [{"record": f"dashboard:query_{i}:check", "expr": expr} for i, expr in enumerate(exprs)]
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    output = _promtool("check", "rules", str(path))
    assert f"{len(exprs)} rules found" in output, output


# --- Grafana provisioning --------------------------------------------------------------------------------

def test_grafana_provisioning() -> None:
    (ds,) = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"]
    assert (ds["name"], ds["type"], ds["uid"], ds["url"]) == ("Prometheus", "prometheus", "prometheus",
                                                             "http://prometheus:9090")
    (provider,) = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/pdserve.yml").read_text())["providers"]
    assert provider["type"] == "file" and provider["options"]["path"] == "/var/lib/grafana/dashboards"
