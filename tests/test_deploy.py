"""The deploy files work as written: each Kubernetes overlay renders and validates against the
Kubernetes schemas, compose and the Dockerfile agree with the proxy's settings, and the settings,
mounts, probes and scrape targets they declare are run for real (the proxy started with exactly
their environment, its Redis with exactly their arguments)."""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from proxy.cli import _parser
from proxy.config import OPTION_NAMES, Settings, build_settings
from tests.support import Anvil, RedisServer, free_port, wait_until

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
KUBE = DEPLOY / "kubernetes"
OVERLAYS = ("sidecar", "standalone")
KUBERNETES_VERSION = "1.30"  # the oldest Kubernetes the manifests target
EXAMPLE_SECRET = "example-key-replace-me"  # the example key's secret, written in keys.example.toml
FILE_SETTINGS = ("API_KEYS_FILE", "NETWORKS_FILE", "CREDITS_JOURNAL_DIR")  # settings that name a path
PROXY = "rpc-cache-proxy"  # the proxy's container (Kubernetes) and image name


# --- reading the files -----------------------------------------------------------------------


def render(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl missing: scripts/test.sh installs it where apt has it (the Kubernetes apt repository)"
    out = subprocess.run(
        [kubectl, "kustomize", str(KUBE / "overlays" / overlay)], capture_output=True, text=True, check=True
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def workload_with(docs: list[dict[str, Any]], container: str) -> dict[str, Any]:
    found = [
        d
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
        and any(c["name"] == container for c in d["spec"]["template"]["spec"]["containers"])
    ]
    assert len(found) == 1, f"one workload runs {container}"
    return found[0]


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def container_env(docs: list[dict[str, Any]], c: dict[str, Any]) -> dict[str, str]:
    """The environment a container starts with: envFrom ConfigMaps and Secrets, then env (which wins)."""
    env: dict[str, str] = {}
    maps, secrets = by_kind(docs, "ConfigMap"), by_kind(docs, "Secret")
    for source in c.get("envFrom", []):
        if "configMapRef" in source:
            env.update(maps[source["configMapRef"]["name"]]["data"])
        else:
            data = secrets[source["secretRef"]["name"]]["data"]
            env.update({k: base64.b64decode(v).decode() for k, v in data.items()})
    env.update({e["name"]: e["value"] for e in c.get("env", [])})
    return env


def mounted_files(docs: list[dict[str, Any]], workload: dict[str, Any], c: dict[str, Any]) -> dict[str, bytes]:
    """Files a container sees from its Secret and ConfigMap volumes: path -> content."""
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"].get("volumes", [])}
    secrets, maps = by_kind(docs, "Secret"), by_kind(docs, "ConfigMap")
    files: dict[str, bytes] = {}
    for mount in c.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        if "secret" in volume:
            data = {k: base64.b64decode(v) for k, v in secrets[volume["secret"]["secretName"]]["data"].items()}
            items = volume["secret"].get("items")
        elif "configMap" in volume:
            data = {k: v.encode() for k, v in maps[volume["configMap"]["name"]]["data"].items()}
            items = volume["configMap"].get("items")
        else:
            continue
        for item in items or [{"key": k, "path": k} for k in data]:
            files[str(PurePosixPath(mount["mountPath"]) / item["path"])] = data[item["key"]]
    return files


def named_ports(c: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c.get("ports", [])}


def compose() -> dict[str, Any]:
    return dict(yaml.safe_load((DEPLOY / "docker-compose.yml").read_text()))


def interpolate(value: str, environ: Mapping[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?error} as compose expands them."""

    def one(match: re.Match[str]) -> str:
        name, op, arg = match.group(1), match.group(2), match.group(3) or ""
        if environ.get(name):
            return environ[name]
        if op == ":?":
            raise AssertionError(f"compose needs {name}: {arg}")
        return arg if op == ":-" else ""

    return re.sub(r"\$\{(\w+)(:-|:\?)?([^}]*)\}", one, value)


@dataclass
class Dockerfile:
    instructions: list[tuple[str, str]]

    @classmethod
    def read(cls) -> Dockerfile:
        text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
        lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
        return cls([(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines])

    def all(self, name: str) -> list[str]:
        return [arg for instruction, arg in self.instructions if instruction == name]

    def env(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for arg in self.all("ENV"):
            env.update(dict(part.split("=", 1) for part in shlex.split(arg)))
        return env

    def exec_form(self, name: str) -> list[str]:
        (arg,) = self.all(name)
        return list(json.loads(arg))


def settings_of(env: Mapping[str, str], files: Mapping[str, bytes], tmp: Path) -> Settings:
    """The settings the proxy would build from a deploy file's environment, its mounted files
    written under `tmp` (the same bytes at a local path)."""
    local = dict(env)
    for name in FILE_SETTINGS:
        if name in env:
            assert env[name] in files, f"{name}={env[name]} is not mounted"
            path = tmp / name
            path.write_bytes(files[env[name]])
            local[name] = str(path)
    return build_settings(local)


# --- running what a file declares --------------------------------------------------------------


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


def post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@contextmanager
def redis_as_declared(command: list[str], tmp: Path) -> Iterator[RedisServer]:
    """A redis-server started with a deploy file's own arguments (its data directory moved to tmp)."""
    assert command[0] == "redis-server"
    args = list(command[1:])
    if "--dir" in args:
        args[args.index("--dir") + 1] = str(tmp)
    server = RedisServer(*args)
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def proxy_running(env: Mapping[str, str], tmp: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`python -m proxy` with exactly `env` (plus PATH), from an empty directory."""
    base = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
    with open(tmp / "stderr", "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "proxy"], env={**base, **env}, cwd=tmp, stdout=subprocess.DEVNULL, stderr=err
        )
        try:
            yield proc
        finally:
            proc.terminate()
            proc.wait(15)


def live_env(
    env: Mapping[str, str], anvil: Anvil, redis: Mapping[str, RedisServer], files: Mapping[str, bytes], tmp: Path
) -> dict[str, str]:
    """A deploy file's environment made runnable here: loopback and free ports for its listeners,
    Anvil for its upstreams, local servers for the Redis hosts it names, mounted files at local paths."""
    local = dict(env)
    local.update(
        PROXY_HOST="127.0.0.1",
        PROXY_PORT=str(free_port()),
        METRICS_HOST="127.0.0.1",
        METRICS_PORT=str(free_port()),
        HEAD_POLL_INTERVAL="0.2",
    )
    for name, value in env.items():
        if name.endswith("_UPSTREAM") and value:
            local[name] = anvil.url
        elif name.endswith("_UPSTREAM_WS") and value:
            local[name] = anvil.url.replace("http", "ws")
        elif name.endswith("REDIS_URL"):
            local[name] = redis[urlsplit(value).hostname or ""].url
    for name in FILE_SETTINGS:
        if name in env:
            (tmp / name).write_bytes(files[env[name]])
            local[name] = str(tmp / name)
    return local


def serves_as_declared(
    env: Mapping[str, str],
    *,
    health_path: str,
    ready_path: str,
    metrics_path: str,
    tmp: Path,
    healthcheck: list[str] | None = None,
) -> None:
    """The proxy started with `env` answers the declared probe and scrape paths, keeps /metrics off the
    public port, and accepts the example key (and only keys it knows). `healthcheck`, a command run
    with the proxy's environment, must pass while it serves and fail once it is gone."""
    public = f"http://127.0.0.1:{env['PROXY_PORT']}"
    internal = f"http://127.0.0.1:{env['METRICS_PORT']}"
    with proxy_running(env, tmp) as proc:
        # The probes on the metrics port (off the public port's MAX_CONNECTIONS), as on the public one.
        for base in (internal, public):
            served = lambda b=base: get(b + health_path)[0] == 200 or proc.poll() is not None  # noqa: E731
            wait_until(served, 20, "the proxy to serve")
            assert proc.poll() is None, (tmp / "stderr").read_text()
            wait_until(lambda b=base: get(b + ready_path)[0] == 200, 20, "the proxy to be ready")
        status, body = get(internal + metrics_path)
        assert status == 200 and b"rpc_proxy_requests_total" in body
        assert get(public + metrics_path)[0] == 404  # /metrics stays internal
        call = {"jsonrpc": "2.0", "id": 1, "method": "eth_chainId"}
        status, body = post(f"{public}/v3/{EXAMPLE_SECRET}", call)
        assert status == 200 and json.loads(body)["result"] == "0x7a69", body
        assert post(f"{public}/v3/not-a-configured-key", call)[0] == 401  # keys in force: not open
        if healthcheck is not None:
            assert subprocess.run(healthcheck, env=env).returncode == 0
            # Docker passes its client's proxy settings into containers: the check never goes through one.
            proxied = {**env, "http_proxy": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9"}
            assert subprocess.run(healthcheck, env=proxied).returncode == 0
    if healthcheck is not None:
        assert subprocess.run(healthcheck, env=env, capture_output=True).returncode != 0  # stopped: unhealthy


# --- Kubernetes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_object_is_valid_against_the_kubernetes_schemas(overlay: str) -> None:
    docs = render(overlay)
    assert docs
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message}") from exc


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_proxy_container_uses_only_real_settings_and_valid_values(overlay: str, tmp_path: Path) -> None:
    docs = render(overlay)
    workload = workload_with(docs, PROXY)
    proxy = container(workload, PROXY)
    env = container_env(docs, proxy)
    assert set(env) <= OPTION_NAMES, f"not settings: {set(env) - OPTION_NAMES}"
    settings = settings_of(env, mounted_files(docs, workload, proxy), tmp_path)
    assert settings.api_keys is not None  # the keys Secret is mounted where API_KEYS_FILE says: not open
    ports = named_ports(proxy)
    assert ports["rpc"] == settings.port and ports["metrics"] == settings.metrics_port
    assert settings.host == settings.metrics_host == "0.0.0.0"  # reachable by the kubelet and Prometheus
    grace = workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > settings.shutdown_timeout  # SIGTERM drains before SIGKILL


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_and_scrape_annotations_point_at_the_proxy_listeners(overlay: str) -> None:
    docs = render(overlay)
    workload = workload_with(docs, PROXY)
    proxy = container(workload, PROXY)
    env, ports = container_env(docs, proxy), named_ports(proxy)

    def port_of(probe: dict[str, Any]) -> int:
        port = probe["httpGet"]["port"]
        return ports[port] if isinstance(port, str) else int(port)

    assert proxy["livenessProbe"]["httpGet"]["path"] == "/healthz"
    # Replicas sharing remote upstreams stay ready through the upstreams' faults once started (/readyz?started);
    # a pod with its own node beside it is taken out when that node fails.
    ready = {"standalone": "/readyz?started", "sidecar": "/readyz"}[overlay]
    assert proxy["readinessProbe"]["httpGet"]["path"] == ready
    # On the metrics port: a connection flood filling the public port's MAX_CONNECTIONS fails no probe.
    assert port_of(proxy["livenessProbe"]) == port_of(proxy["readinessProbe"]) == int(env["METRICS_PORT"])
    assert proxy["lifecycle"]["preStop"]["sleep"]["seconds"] < workload["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"
    ] - int(env.get("SHUTDOWN_TIMEOUT", "25"))  # endpoints removed, then the drain, within the grace period
    annotations = workload["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == int(env["METRICS_PORT"]) != int(env["PROXY_PORT"])
    # The Service apps call exposes the public port only.
    service = by_kind(docs, "Service")[PROXY]
    assert [ports[p["targetPort"]] for p in service["spec"]["ports"]] == [int(env["PROXY_PORT"])]
    assert service["spec"]["selector"].items() <= workload["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_redis_the_config_names_is_defined_with_the_right_eviction_policy(overlay: str) -> None:
    docs = render(overlay)
    env = container_env(docs, container(workload_with(docs, PROXY), PROXY))
    services = by_kind(docs, "Service")
    for name, policy in (("REDIS_URL", "allkeys-lru"), ("CREDITS_REDIS_URL", "noeviction")):
        url = urlsplit(env[name])
        service = services[url.hostname or ""]
        assert url.port in [p["port"] for p in service["spec"]["ports"]]
        server = next(
            d
            for d in docs
            if d["kind"] in ("Deployment", "StatefulSet")
            and service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
        )
        redis = server["spec"]["template"]["spec"]["containers"][0]
        assert redis["command"][redis["command"].index("--maxmemory-policy") + 1] == policy
        # A bound under the container's limit: refused writes (noeviction) or evictions, never an OOM kill.
        bound = redis["command"][redis["command"].index("--maxmemory") + 1]
        limit = redis["resources"]["limits"]["memory"]
        assert int(bound.removesuffix("mb").removesuffix("gb")) * (1024 if bound.endswith("gb") else 1) < int(
            limit.removesuffix("Mi")
        ), (bound, limit)
        assert any(p["containerPort"] == url.port for p in redis["ports"])
    assert env["REDIS_URL"] != env["CREDITS_REDIS_URL"] and env["CREDITS_REQUIRE_NOEVICTION"] == "true"
    ledger = by_kind(docs, "StatefulSet")[urlsplit(env["CREDITS_REDIS_URL"]).hostname or ""]
    mounts = ledger["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert [m["name"] for m in mounts] == [t["metadata"]["name"] for t in ledger["spec"]["volumeClaimTemplates"]]


def test_sidecar_overlay_runs_the_node_in_the_proxy_pod_with_its_data_on_a_mounted_volume() -> None:
    docs = render("sidecar")
    workload = workload_with(docs, PROXY)
    node = container(workload, "node")
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    (mount,) = node["volumeMounts"]
    claim = volumes[mount["name"]]["persistentVolumeClaim"]["claimName"]
    assert claim in by_kind(docs, "PersistentVolumeClaim")
    assert f"--datadir={mount['mountPath']}" in node["args"]  # the node writes its chain to that volume
    # Only one pod can own a ReadWriteOnce volume: one replica, replaced (not rolled).
    assert workload["spec"]["replicas"] == 1 and workload["spec"]["strategy"]["type"] == "Recreate"
    env = container_env(docs, container(workload, PROXY))
    upstream, ws = urlsplit(env["EVM_UPSTREAM"]), urlsplit(env["EVM_UPSTREAM_WS"])
    assert upstream.hostname == ws.hostname == "127.0.0.1"  # the node in the same pod
    assert f"--http.port={upstream.port}" in node["args"] and f"--ws.port={ws.port}" in node["args"]
    assert upstream.port != int(env["PROXY_PORT"])  # the node moved off 8545, the proxy's port


def test_standalone_overlay_scales_the_proxy_with_an_hpa_and_a_disruption_budget() -> None:
    docs = render("standalone")
    workload = workload_with(docs, PROXY)
    assert [c["name"] for c in workload["spec"]["template"]["spec"]["containers"]] == [PROXY]
    (hpa,) = by_kind(docs, "HorizontalPodAutoscaler").values()
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == (workload["kind"], workload["metadata"]["name"])
    assert hpa["spec"]["minReplicas"] >= 2
    assert "replicas" not in workload["spec"]  # the HPA's: a count here would reset it on every apply
    assert container(workload, PROXY)["resources"]["requests"]["cpu"]  # the HPA's utilization needs a request
    (pdb,) = by_kind(docs, "PodDisruptionBudget").values()
    assert pdb["spec"]["selector"]["matchLabels"].items() <= workload["spec"]["template"]["metadata"]["labels"].items()
    # Upstream URLs may carry a provider key: they come from a Secret, not the ConfigMap.
    assert all("EVM_UPSTREAM" not in m["data"] for m in by_kind(docs, "ConfigMap").values())
    assert "EVM_UPSTREAM" in container_env(docs, container(workload, PROXY))


def test_the_prometheus_operator_podmonitor_selects_the_proxy_pods_metrics_port() -> None:
    monitor = yaml.safe_load((KUBE / "extras/podmonitor.yaml").read_text())
    docs = render("standalone")
    workload = workload_with(docs, PROXY)
    labels = workload["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in named_ports(container(workload, PROXY)) and endpoint["path"] == "/metrics"


def test_the_kubernetes_keys_file_is_the_example_keys_file() -> None:
    assert (KUBE / "base/keys.toml").read_bytes() == (DEPLOY / "keys.example.toml").read_bytes()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_rendered_proxy_serves_its_probes_and_scrape_path_with_the_mounted_keys(
    overlay: str,
    anvil: Anvil,
    tmp_path: Path,
) -> None:
    docs = render(overlay)
    workload = workload_with(docs, PROXY)
    proxy = container(workload, PROXY)
    env = container_env(docs, proxy)
    with (
        redis_as_declared(_redis_command(docs, env["REDIS_URL"]), tmp_path / "cache") as cache,
        redis_as_declared(_redis_command(docs, env["CREDITS_REDIS_URL"]), tmp_path) as ledger,
    ):
        servers = {
            urlsplit(env["REDIS_URL"]).hostname or "": cache,
            urlsplit(env["CREDITS_REDIS_URL"]).hostname or "": ledger,
        }
        local = live_env(env, anvil, servers, mounted_files(docs, workload, proxy), tmp_path)
        serves_as_declared(
            local,
            health_path=proxy["livenessProbe"]["httpGet"]["path"],
            ready_path=proxy["readinessProbe"]["httpGet"]["path"],
            metrics_path=workload["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"],
            tmp=tmp_path,
        )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_proxys_pods_may_reach_the_cache_and_ledger_redis(overlay: str) -> None:
    """Rule (docs/caching.md, Tiers): Redis must be reachable by the proxy alone (a value another pod
    wrote to the cache is served as the proxy's own; one written to the ledger gives credits back)."""
    docs = render(overlay)
    env = container_env(docs, container(workload_with(docs, PROXY), PROXY))
    (policy,) = by_kind(docs, "NetworkPolicy").values()
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    (selector,) = spec["podSelector"]["matchExpressions"]
    for url in (env["REDIS_URL"], env["CREDITS_REDIS_URL"]):
        service = by_kind(docs, "Service")[urlsplit(url).hostname or ""]
        server = next(
            d
            for d in docs
            if d["kind"] in ("Deployment", "StatefulSet")
            and service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
        )
        labels = server["spec"]["template"]["metadata"]["labels"]
        assert selector["operator"] == "In" and labels[selector["key"]] in selector["values"]  # the policy holds it
        ports = {p["name"] for c in server["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
        assert {p["port"] for rule in spec["ingress"] for p in rule["ports"]} <= ports
    (rule,) = spec["ingress"]
    (source,) = rule["from"]
    proxy_labels = workload_with(docs, PROXY)["spec"]["template"]["metadata"]["labels"]
    assert source["podSelector"]["matchLabels"].items() <= proxy_labels.items()  # the proxy's pods, and no others
    assert set(source) == {"podSelector"}  # no namespaceSelector or ipBlock beside it


def _redis_command(docs: list[dict[str, Any]], url: str) -> list[str]:
    service = by_kind(docs, "Service")[urlsplit(url).hostname or ""]
    server = next(
        d
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
        and service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
    )
    return list(server["spec"]["template"]["spec"]["containers"][0]["command"])


# --- docker compose and the Dockerfile ----------------------------------------------------------


UPSTREAM_VARIABLES = ("ETH_MAINNET_URL", "ETH_MAINNET_BACKUP_URL", "BASE_MAINNET_URL", "SOLANA_MAINNET_URL")


def compose_proxy_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The proxy service's environment: the image's ENV, then compose's environment over it."""
    service = compose()["services"]["proxy"]
    env = Dockerfile.read().env()
    env.pop("PYTHONUNBUFFERED")
    env.update({k: interpolate(str(v), environ) for k, v in service["environment"].items()})
    return {k: v for k, v in env.items() if v != ""}  # an empty ${VAR:-} is an unset setting


def compose_mounts(service: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Path]:
    """Bind mounts of a compose service: container path -> the host path (relative to deploy/)."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = interpolate(volume, environ).split(":")[:2]
        if source.startswith((".", "/")):
            mounts[target] = (DEPLOY / source).resolve()
    return mounts


def test_compose_uses_only_real_settings_and_mounts_every_file_it_names(tmp_path: Path) -> None:
    environ = {"EVM_UPSTREAM": "http://node.invalid:8546"}
    env = compose_proxy_env(environ)
    assert set(env) <= OPTION_NAMES, f"not settings: {set(env) - OPTION_NAMES}"
    mounts = compose_mounts(compose()["services"]["proxy"], environ)
    for name in FILE_SETTINGS:
        if name in env:
            assert env[name] in mounts and mounts[env[name]].is_file(), f"{name} is not mounted"
    settings = settings_of(env, {path: host.read_bytes() for path, host in mounts.items()}, tmp_path)
    assert settings.api_keys is not None  # keys in force: the proxy does not run open


def test_compose_serves_the_networks_file_alone_when_evm_upstream_is_unset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Compose required EVM_UPSTREAM, and set beside NETWORKS_FILE it is a network of its own (evm),
    # the default of /v3/KEY ahead of the file's eth-mainnet.
    environ = {"NETWORKS_FILE": "/etc/rpc-proxy/networks.toml"}
    env = compose_proxy_env(environ)
    assert "EVM_UPSTREAM" not in env
    for i, name in enumerate(UPSTREAM_VARIABLES):  # deploy/upstreams.env, which compose passes on
        monkeypatch.setenv(name, f"http://node{i}.invalid:8546")
    mounts = compose_mounts(compose()["services"]["proxy"], environ)
    settings = settings_of(env, {path: host.read_bytes() for path, host in mounts.items()}, tmp_path)
    assert "evm" not in {network.name for network in settings.networks}
    assert settings.default_network["evm"] == "eth-mainnet"


def test_compose_publishes_the_public_port_only_and_prometheus_scrapes_the_metrics_port() -> None:
    services = compose()["services"]
    env = compose_proxy_env({"EVM_UPSTREAM": "http://node.invalid:8546"})
    published = [str(p).rsplit(":", 1)[-1] for p in services["proxy"]["ports"]]
    assert published == [env["PROXY_PORT"]] and env["METRICS_PORT"] not in published
    assert env["METRICS_HOST"] == "0.0.0.0"  # reachable on the compose network
    scrape = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["scrape_configs"][0]
    assert scrape["static_configs"][0]["targets"] == [f"proxy:{env['METRICS_PORT']}"]
    assert scrape["metrics_path"] == "/metrics"
    for name in ("prometheus", "grafana"):  # their UIs show the metrics: loopback only
        assert all(str(p).startswith("127.0.0.1:") for p in services[name]["ports"])


def test_compose_keeps_the_ledger_on_its_own_noeviction_redis() -> None:
    services = compose()["services"]
    env = compose_proxy_env({"EVM_UPSTREAM": "http://node.invalid:8546"})
    cache, ledger = urlsplit(env["REDIS_URL"]).hostname, urlsplit(env["CREDITS_REDIS_URL"]).hostname
    assert cache != ledger and {cache, ledger} <= set(services)
    policy = {
        name: services[name]["command"][services[name]["command"].index("--maxmemory-policy") + 1]
        for name in (cache, ledger)
    }
    assert policy == {cache: "allkeys-lru", ledger: "noeviction"}
    assert env["CREDITS_REQUIRE_NOEVICTION"] == "true"
    assert any(v.endswith(":/data") for v in services[ledger]["volumes"])  # the append-only file persists


def test_compose_config_is_accepted_by_docker_compose_when_it_is_installed() -> None:
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("docker compose is not installed here; the other compose tests parse the file")
    result = subprocess.run(
        [docker, "compose", "-f", str(DEPLOY / "docker-compose.yml"), "config", "-q"],
        capture_output=True,
        text=True,
        env={**os.environ, "EVM_UPSTREAM": "http://n:8546"},
    )
    assert result.returncode == 0, result.stderr


def test_dockerfile_pins_its_base_image_runs_non_root_and_copies_what_exists() -> None:
    docker = Dockerfile.read()
    (arg,) = [a for a in docker.all("ARG") if a.startswith("PYTHON_IMAGE=")]
    assert re.fullmatch(r"PYTHON_IMAGE=python:3\.11\.\d+-slim-bookworm(@sha256:[0-9a-f]{64})?", arg), arg
    assert all(base.split()[0] == "${PYTHON_IMAGE}" for base in docker.all("FROM"))
    user = docker.all("USER")[-1].split(":")[0]
    assert user.isdigit() and int(user) != 0
    for copy in docker.all("COPY"):
        if not copy.startswith("--from"):
            for source in copy.split()[:-1]:
                assert (ROOT / source).exists(), source
    assert "--build-arg PYTHON_IMAGE=" in (DEPLOY / "Dockerfile").read_text()  # how to pin a digest


def test_dockerfile_command_ports_and_healthcheck_match_the_proxy_settings() -> None:
    docker = Dockerfile.read()
    settings = build_settings({**docker.env(), "EVM_UPSTREAM": "http://node.invalid:8546"})
    command = docker.exec_form("ENTRYPOINT") + docker.exec_form("CMD")
    assert command[0] == "rpc-proxy" and 'rpc-proxy = "proxy.__main__:main"' in (ROOT / "pyproject.toml").read_text()
    assert _parser().parse_args(command[1:]).command == "serve"
    exposed = {int(p) for arg in docker.all("EXPOSE") for p in arg.split()}
    assert exposed == {settings.port}  # the metrics port is never published (docker run -P publishes EXPOSE)
    assert settings.host == settings.metrics_host == "0.0.0.0"
    healthcheck = docker.all("HEALTHCHECK")[0]
    assert "/healthz" in healthcheck and "METRICS_PORT" in healthcheck and "PROXY_PORT" in healthcheck


def healthcheck_command() -> list[str]:
    healthcheck = Dockerfile.read().all("HEALTHCHECK")[0]
    return list(json.loads(healthcheck.split("CMD", 1)[1]))


def test_compose_proxy_with_its_own_redis_serves_and_the_image_healthcheck_passes(
    anvil: Anvil,
    tmp_path: Path,
) -> None:
    services = compose()["services"]
    environ = {"EVM_UPSTREAM": anvil.url}
    env = compose_proxy_env(environ)
    mounts = compose_mounts(services["proxy"], environ)
    files = {path: host.read_bytes() for path, host in mounts.items()}
    cache_host = urlsplit(env["REDIS_URL"]).hostname or ""
    ledger_host = urlsplit(env["CREDITS_REDIS_URL"]).hostname or ""
    with (
        redis_as_declared(services[cache_host]["command"], tmp_path / "cache") as cache,
        redis_as_declared(services[ledger_host]["command"], tmp_path) as ledger,
    ):
        local = live_env(env, anvil, {cache_host: cache, ledger_host: ledger}, files, tmp_path)
        # The image's HEALTHCHECK as Docker runs it: the image's python, the container's environment.
        check = healthcheck_command()
        assert check[0] == "python"
        serves_as_declared(
            local,
            health_path="/healthz",
            ready_path="/readyz",
            metrics_path="/metrics",
            tmp=tmp_path,
            healthcheck=[sys.executable, *check[1:]],
        )
