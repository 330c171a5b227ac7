"""The user's whole stack on the loopback dev cluster: chart, operator, agents, traces.

Used by ``test_user_story.py``, ``bench/e2e_timings.py`` and ``hack/demo`` (``python
tests/e2e/story_support.py serve ...`` runs the stack in the foreground until a signal).

What a real cluster would do and the dev cluster does not, done here on loopback:

- ``helm install`` the chart, then run ``kvpool operator`` as a local process under the
  chart's ServiceAccount (a TokenRequest token, so the chart's RBAC is what it gets);
- the kubelet's part for agent pods: kwok marks them Running with a 127.x IP, and
  ``PodAgentHarness`` starts the container's command for each. ``LoopbackKubelet`` projects
  the pod's ConfigMap and Secret volumes into a per-pod directory (kept in sync every second,
  as kubelet does, so live config edits and rotated credentials reach the running agent),
  rewrites the mount paths in the command line and in the projected config (the agent's
  credential files), and runs the readiness probe kwok does not: a pod is Ready only while
  its agent answers ``/readyz``;
- cluster DNS for the pods' stable names: the operator lists the pool's pods as handoff peers
  by their StatefulSet DNS names (``pool-0.pool.ns.svc``). ``PeerProxies`` gives each such
  name a fixed 127.0.0.1 port that forwards to the pod's current IP, and the projected
  config names that port, so a warm handoff reaches whichever pod holds the name now.

Agents authenticate (the operator's ``<pool>-auth`` Secret): whatever talks to them here
presents the token of the pool's ``default`` tenant, read from ``<pool>-tenant-default``
(``tenant_token``), as a client pod mounting that Secret would.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvpool_agent.drive import DriveResult
from kvpool_agent.replay.synth import SAMPLE_TRACE
from kvpool_agent.traces import Trace
from kvpool_operator.devcluster.certs import issue_client_cert, service_account_identity
from kvpool_operator.devcluster.cluster import DevCluster, set_parent_death_signal
from kvpool_operator.devcluster.podagents import PodAgentHarness, PodInfo

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvpool"
EXAMPLES = REPO / "crds" / "examples"
AGENT_SELECTOR = "app.kubernetes.io/name=kvpool-agent"
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""Loopback only: an HTTP(S)_PROXY in the environment must never catch these calls."""


# -- traces ---------------------------------------------------------------------------------


def story_trace() -> Path:
    """The workload of the story: the trace the repository ships (``kvpool trace synth``)."""
    return SAMPLE_TRACE


# -- small helpers --------------------------------------------------------------------------


def wait_until(what: str, probe: Callable[[], Any], timeout: float, every: float = 0.25) -> Any:
    """Poll ``probe`` until it returns something truthy; AssertionError naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)


def http_get(
    url: str, timeout: float = 2.0, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    try:
        with _DIRECT.open(
            urllib.request.Request(url, headers=headers or {}), timeout=timeout
        ) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as err:
        return int(err.code), err.read()


def agent_ready(url: str) -> bool:
    try:
        return http_get(f"{url}/readyz", timeout=2.0)[0] == 200
    except OSError:
        return False


def get_json(cluster: DevCluster, namespace: str | None, *what: str) -> dict[str, Any] | None:
    ns = ["-n", namespace] if namespace else []
    result = cluster.kubectl("get", *ns, *what, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def tenant_token(
    cluster: DevCluster, namespace: str, pool: str, tenant: str = "default", timeout: float = 60.0
) -> str:
    """The bearer token a client of the pool presents: key ``token`` of the operator's
    ``<pool>-tenant-<tenant>`` Secret (what a client pod mounts)."""

    def read() -> str | None:
        secret = get_json(cluster, namespace, f"secret/{pool}-tenant-{tenant}")
        raw = ((secret or {}).get("data") or {}).get("token")
        return base64.b64decode(raw).decode().strip() if raw else None

    token: str = wait_until(f"Secret {pool}-tenant-{tenant}", read, timeout)
    return token


def condition(obj: dict[str, Any] | None, kind: str) -> str | None:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            return str(cond.get("status"))
    return None


# -- cluster DNS for the pods' stable names -------------------------------------------------


_FORWARDED_HEADERS = ("content-type", "authorization", "accept")


class _Forwarder(http.server.BaseHTTPRequestHandler):
    """Forwards one request to the pod that holds the proxy's name now."""

    target: Callable[[], str | None]

    def _forward(self) -> None:
        base = type(self).target()
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else None
        if base is None:
            self.send_error(502, "no pod holds this name now")
            return
        req = urllib.request.Request(f"{base}{self.path}", data=body, method=self.command)
        for name in _FORWARDED_HEADERS:  # the peer token travels with a handoff
            if self.headers.get(name):
                req.add_header(name, self.headers[name])
        try:
            with _DIRECT.open(req, timeout=60) as resp:
                status, data, ctype = resp.status, resp.read(), resp.headers.get("content-type")
        except urllib.error.HTTPError as err:
            status, data, ctype = err.code, err.read(), err.headers.get("content-type")
        except OSError as err:
            self.send_error(502, f"pod unreachable: {err}")
            return
        self.send_response(status)
        if ctype:
            self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_DELETE = _forward

    def log_message(self, *args: object) -> None:
        pass


class PeerProxies:
    """One loopback port per pod DNS name (``name.svc.ns.svc:port``), forwarding to the pod's
    current IP (kept in ``pod_ips`` by ``LoopbackKubelet``)."""

    def __init__(self) -> None:
        self.pod_ips: dict[tuple[str, str], str] = {}
        self._servers: dict[tuple[str, str, int], http.server.ThreadingHTTPServer] = {}
        self._lock = threading.Lock()

    def url_for(self, namespace: str, pod: str, port: int) -> str:
        key = (namespace, pod, port)
        with self._lock:
            server = self._servers.get(key)
            if server is None:

                def target() -> str | None:
                    ip = self.pod_ips.get((namespace, pod))
                    return f"http://{ip}:{port}" if ip else None

                handler = type("Forwarder", (_Forwarder,), {"target": staticmethod(target)})
                server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
                server.daemon_threads = True
                threading.Thread(target=server.serve_forever, daemon=True).start()
                self._servers[key] = server
            return f"http://127.0.0.1:{server.server_address[1]}"

    def translate(self, url: str) -> str:
        """``http://pod.svc.ns.svc[.cluster.local]:port`` -> this proxy's URL; others as-is."""
        parts = urllib.parse.urlsplit(url)
        labels = (parts.hostname or "").split(".")
        if len(labels) >= 4 and labels[3] == "svc":
            return self.url_for(labels[2], labels[0], parts.port or 80)
        return url

    def close(self) -> None:
        with self._lock:
            for server in self._servers.values():
                server.shutdown()
                server.server_close()
            self._servers.clear()


# -- the kubelet's part: ConfigMap and Secret volumes and the container command --------------


@dataclass
class _Mount:
    kind: str
    """``configmap`` or ``secret``."""
    name: str
    local_dir: Path
    items: dict[str, str] | None = None


@dataclass
class _PodFiles:
    pod: PodInfo
    mounts: list[_Mount] = field(default_factory=list)
    rewrites: dict[str, str] = field(default_factory=dict)
    """Mount path in the pod -> the local directory standing for it."""


class LoopbackKubelet:
    """A ``CommandFactory`` for ``PodAgentHarness`` that runs agent pods like a kubelet would.

    For each pod it projects the ConfigMap and Secret volumes (data base64-decoded, as kubelet
    writes them) into ``workdir/pods/<ns>_<name>_<uid>``, rewrites mount paths in the
    container's command line and in the projected ConfigMap text (the agent config names its
    credential files by their mount paths), runs ``kvpool`` as this Python's module, and binds
    the pod IP (the pod's own network namespace in a real cluster). ``sync()`` (every second
    from ``start()``) re-projects changed ConfigMaps and Secrets and refreshes the pod IPs
    behind ``PeerProxies``.
    """

    def __init__(
        self,
        kubeconfig: Path,
        namespace: str,
        workdir: Path,
        proxies: PeerProxies,
        interval: float = 1.0,
    ) -> None:
        from kubernetes import client, config

        self.namespace = namespace
        self.workdir = workdir
        self.proxies = proxies
        self.interval = interval
        self._api_client = config.new_client_from_config(config_file=str(kubeconfig))
        self.core = client.CoreV1Api(self._api_client)
        self._pods: dict[str, _PodFiles] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []

    def __call__(self, pod: PodInfo) -> Sequence[str] | None:
        if pod.labels.get("app.kubernetes.io/name") != "kvpool-agent":
            return None
        obj: Any = self.core.read_namespaced_pod(pod.name, pod.namespace)
        # kwok marked the pod Ready with nothing running yet: not until the agent answers.
        self._probe_readiness(obj, ready=False)
        spec = obj.spec
        container = spec.containers[0]
        root = self.workdir / "pods" / f"{pod.namespace}_{pod.name}_{pod.uid[:8]}"
        volumes = {v.name: v for v in spec.volumes or []}
        files = _PodFiles(pod)
        rewrites: dict[str, str] = {}
        for vm in container.volume_mounts or []:
            local = root / vm.mount_path.lstrip("/")
            local.mkdir(parents=True, exist_ok=True)
            rewrites[vm.mount_path] = str(local)
            volume = volumes.get(vm.name)
            if volume is not None and volume.config_map is not None:
                items = {i.key: i.path for i in volume.config_map.items or []} or None
                files.mounts.append(_Mount("configmap", volume.config_map.name, local, items))
            elif volume is not None and volume.secret is not None:
                items = {i.key: i.path for i in volume.secret.items or []} or None
                files.mounts.append(_Mount("secret", volume.secret.secret_name, local, items))
        files.rewrites = rewrites
        self.proxies.pod_ips[(pod.namespace, pod.name)] = pod.pod_ip
        self._project(files, {})
        with self._lock:
            self._pods[pod.uid] = files
        argv = container_argv([*(container.command or []), *(container.args or [])], rewrites)
        port = next((p.container_port for p in container.ports or [] if p.name == "http"), 8000)
        return [*argv, "--host", pod.pod_ip, "--port", str(port)]

    def _read(self, mount: _Mount, namespace: str) -> dict[str, str] | None:
        """A volume's files as kubelet writes them: ConfigMap text, Secret data decoded."""
        try:
            if mount.kind == "secret":
                secret: Any = self.core.read_namespaced_secret(mount.name, namespace)
                return {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}
            cm: Any = self.core.read_namespaced_config_map(mount.name, namespace)
            return dict(cm.data or {})
        except Exception as err:  # not there yet: like kubelet, retry on the next pass
            self.errors.append(f"{mount.kind} {mount.name}: {err!r}")
            return None

    def _project(
        self, files: _PodFiles, cache: dict[tuple[str, str], dict[str, str] | None]
    ) -> None:
        for mount in files.mounts:
            key = (mount.kind, mount.name)
            if key not in cache:
                cache[key] = self._read(mount, files.pod.namespace)
            data = cache[key]
            if data is None:
                continue
            for key_name, text in data.items():
                if mount.items is not None and key_name not in mount.items:
                    continue
                name = mount.items[key_name] if mount.items else key_name
                if mount.kind == "configmap":
                    text = self._translate(text, files.rewrites)
                _write_if_changed(mount.local_dir / name, text)

    def _translate(self, text: str, rewrites: dict[str, str]) -> str:
        """Agent config files: handoff peers' DNS names -> their ``PeerProxies`` URLs, and
        paths under a mount (the credential files) -> the pod's local directories."""
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError:
            return text
        if not isinstance(doc, dict):
            return text
        translated = _rewrite_paths(doc, rewrites)
        lifecycle = translated.get("lifecycle")
        if isinstance(lifecycle, dict) and lifecycle.get("handoff_peers"):
            peers = lifecycle["handoff_peers"]
            lifecycle["handoff_peers"] = [self.proxies.translate(str(p)) for p in peers]
        if translated == doc:
            return text
        return yaml.safe_dump(translated, sort_keys=False)

    def sync(self) -> None:
        """One kubelet-like pass: pod IPs behind the proxies, readiness, changed ConfigMaps."""
        pods: Any = self.core.list_namespaced_pod(self.namespace, label_selector=AGENT_SELECTOR)
        live = set()
        for pod in pods.items:
            if pod.status is not None and pod.status.pod_ip and not pod.metadata.deletion_timestamp:
                self.proxies.pod_ips[(self.namespace, pod.metadata.name)] = pod.status.pod_ip
                live.add(pod.metadata.name)
                if pod.status.phase == "Running":
                    self._probe_readiness(pod)
        for key in [k for k in self.proxies.pod_ips if k[0] == self.namespace]:
            if key[1] not in live:
                self.proxies.pod_ips.pop(key, None)
        with self._lock:
            tracked = {u: f for u, f in self._pods.items()}
        uids = {pod.metadata.uid for pod in pods.items}
        cache: dict[tuple[str, str], dict[str, str] | None] = {}
        for uid, files in tracked.items():
            if uid not in uids:
                with self._lock:
                    self._pods.pop(uid, None)
                continue
            self._project(files, cache)

    def _probe_readiness(self, pod: Any, ready: bool | None = None) -> None:
        """The readiness probe kwok does not run: the pod's Ready condition follows the
        agent's ``/readyz`` (kwok sets Running and Ready once, then leaves the status alone),
        so a rollout waits for agents that really serve. ``ready`` overrides the probe."""
        if ready is None:
            ready = agent_ready(f"http://{pod.status.pod_ip}:8000")
        want = "True" if ready else "False"
        conditions = [
            {"type": c.type, "status": c.status, "lastTransitionTime": c.last_transition_time}
            for c in pod.status.conditions or []
        ]
        current = {c["type"]: c["status"] for c in conditions}
        if current.get("Ready") == want and current.get("ContainersReady") == want:
            return
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        for cond in conditions:
            if cond["type"] in ("Ready", "ContainersReady") and cond["status"] != want:
                cond.update(status=want, lastTransitionTime=now)
        for cond in conditions:
            if isinstance(cond["lastTransitionTime"], datetime.datetime):
                cond["lastTransitionTime"] = cond["lastTransitionTime"].strftime(
                    "%Y-%m-%dT%H:%M:%SZ"
                )
        body = {"status": {"conditions": conditions}}
        self.core.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace, body)

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.wait(self.interval):
                try:
                    self.sync()
                except Exception as err:  # keep syncing through transient API errors
                    self.errors.append(f"sync: {err!r}")

        self._thread = threading.Thread(target=loop, name="pod-mounts", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._api_client.close()


def container_argv(argv: Sequence[str], rewrites: dict[str, str]) -> list[str]:
    """The local command line of a container's ``command + args``: its pod paths rewritten to
    the pod's local directories, and ``kvpool`` run as this interpreter's module. Only the
    container's own arguments are rewritten: the interpreter and the project may live
    anywhere, a clone under /tmp included, while /tmp is also a pod volume."""
    out = [_rewrite(arg, rewrites) for arg in argv]
    if out and out[0] == "kvpool":
        out = [sys.executable, "-m", "kvpool_agent.cli", *out[1:]]
    return out


def _rewrite(arg: str, rewrites: dict[str, str]) -> str:
    for mount_path, local in sorted(rewrites.items(), key=lambda kv: -len(kv[0])):
        if arg == mount_path or arg.startswith(mount_path.rstrip("/") + "/"):
            return local + arg[len(mount_path.rstrip("/")) :]
    return arg


def _rewrite_paths(node: Any, rewrites: dict[str, str]) -> Any:
    """Every string in a config document that is a path under a mount, rewritten."""
    if isinstance(node, dict):
        return {k: _rewrite_paths(v, rewrites) for k, v in node.items()}
    if isinstance(node, list):
        return [_rewrite_paths(v, rewrites) for v in node]
    if isinstance(node, str) and node.startswith("/"):
        return _rewrite(node, rewrites)
    return node


def _write_if_changed(path: Path, text: str) -> None:
    """Atomic replace, so the agent's poll never reads half a file."""
    if path.is_file() and path.read_text() == text:
        return
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# -- the chart and the operator under its service account -----------------------------------


def helm_install(
    cluster: DevCluster, release: str, namespace: str, watch: Sequence[str], timer_interval: float
) -> str:
    """``helm install`` the chart serving ``watch``; returns its ServiceAccount's name."""
    values = {"operator": {"watchNamespaces": list(watch), "timerInterval": timer_interval}}
    path = cluster.state_dir / f"values-{release}.yaml"
    path.write_text(yaml.safe_dump(values))
    cluster.helm(
        "install", release, str(CHART), "--namespace", namespace, "--create-namespace",
        "-f", str(path), "--wait=false", timeout=180,
    )  # fmt: skip
    sas = get_json(
        cluster, namespace, "serviceaccounts", "-l", f"app.kubernetes.io/instance={release}"
    )
    names = [sa["metadata"]["name"] for sa in (sas or {}).get("items", [])]
    if len(names) != 1:
        raise AssertionError(f"expected one ServiceAccount of release {release}, got {names}")
    return names[0]


def token_connects(kubeconfig: Path) -> bool:
    """Whether the operator's own client passes a kubeconfig token on to kopf's watches."""
    code = (
        "import sys; from kvpool_operator.kube import KubeApi; "
        "sys.exit(0 if KubeApi.from_environment().connection_info().token else 1)"
    )
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    return subprocess.run([sys.executable, "-c", code], env=env, check=False).returncode == 0


def service_account_kubeconfig(
    cluster: DevCluster, namespace: str, sa: str, path: Path, credential: str = "token"
) -> Path:
    """The admin kubeconfig's cluster entry with the ServiceAccount as the user.

    ``token``: ``kubectl create token`` (a TokenRequest token, as a pod gets).
    ``client-cert``: a cluster-CA certificate for the same user name and groups, for an
    operator build that does not pass tokens to kopf (see ``token_connects``).
    """
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    entry = admin["clusters"][0]
    if credential == "token":
        token = cluster.kubectl("create", "token", sa, "-n", namespace, "--duration=2h")
        user: dict[str, str] = {"token": token.stdout.strip()}
    else:
        user = _service_account_cert(cluster, namespace, sa, path.parent)
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [entry],
        "users": [{"name": sa, "user": user}],
        "contexts": [{"name": sa, "context": {"cluster": entry["name"], "user": sa}}],
        "current-context": sa,
    }
    path.write_text(yaml.safe_dump(doc))
    path.chmod(0o600)
    return path


def _service_account_cert(
    cluster: DevCluster, namespace: str, sa: str, directory: Path
) -> dict[str, str]:
    cert, key = issue_client_cert(cluster.pki, service_account_identity(namespace, sa), directory)
    return {"client-certificate": str(cert), "client-key": str(key)}


def start_operator(
    kubeconfig: Path, namespaces: Sequence[str], timer_interval: float, log: Path
) -> subprocess.Popen[bytes]:
    """``kvpool operator`` as the chart runs it (namespaced, standalone), in its own group."""
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    argv = [
        sys.executable, "-m", "kvpool_agent.cli", "operator", "--standalone",
        f"--timer-interval={timer_interval}",
        *(f"--namespace={ns}" for ns in namespaces),
    ]  # fmt: skip
    with log.open("ab") as out:
        return subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=set_parent_death_signal,
        )


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    """SIGTERM the process group, SIGKILL it after ``grace_s``."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


@dataclass
class Stack:
    """helm install + operator (chart SA) + agents for pools in ``namespace``."""

    cluster: DevCluster
    namespace: str
    workdir: Path
    release: str = "kvpool"
    release_namespace: str = "kvpool-system"
    timer_interval: float = 2.0
    agents: bool = True
    """Run agents for the pool pods (off: pods stay kwok's Running and Ready, nothing runs)."""
    credential: str = ""
    """How the operator authenticated: ``token`` or ``client-cert`` (see token_connects)."""
    operator: subprocess.Popen[bytes] | None = None
    harness: PodAgentHarness | None = None
    mounts: LoopbackKubelet | None = None
    proxies: PeerProxies = field(default_factory=PeerProxies)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def operator_log(self) -> Path:
        return self.workdir / "operator.log"

    def start(self) -> Stack:
        self.workdir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        sa = helm_install(
            self.cluster, self.release, self.release_namespace, [self.namespace],
            self.timer_interval,
        )  # fmt: skip
        self.timings["helm_install_s"] = time.monotonic() - t0
        kubeconfig = self.workdir / "operator.kubeconfig"
        service_account_kubeconfig(self.cluster, self.release_namespace, sa, kubeconfig)
        self.credential = "token"
        if not token_connects(kubeconfig):
            self.credential = "client-cert"
            service_account_kubeconfig(
                self.cluster, self.release_namespace, sa, kubeconfig, credential="client-cert"
            )
        self.operator = start_operator(
            kubeconfig, [self.namespace], self.timer_interval, self.operator_log
        )
        if not self.agents:
            self.timings["stack_start_s"] = time.monotonic() - t0
            return self
        self.mounts = LoopbackKubelet(
            self.cluster.kubeconfig, self.namespace, self.workdir, self.proxies
        )
        self.mounts.start()
        self.harness = PodAgentHarness(
            self.cluster.kubeconfig,
            self.mounts,
            log_dir=self.workdir / "agents",
            namespace=self.namespace,
            label_selector=AGENT_SELECTOR,
            grace_s=20.0,
        )
        self.harness.start()
        self.timings["stack_start_s"] = time.monotonic() - t0
        return self

    def stop(self) -> None:
        if self.operator is not None:
            stop_process(self.operator)
        if self.harness is not None:
            self.harness.stop()
        if self.mounts is not None:
            self.mounts.stop()
        self.proxies.close()
        self.cluster.helm(
            "uninstall", self.release, "--namespace", self.release_namespace, check=False
        )

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def check_operator(self) -> None:
        if self.operator is not None and self.operator.poll() is not None:
            raise AssertionError(
                f"the operator exited ({self.operator.returncode}):\n"
                + self.operator_log.read_text()[-4000:]
            )

    # -- what tests ask ---------------------------------------------------------------------

    def pool(self, name: str) -> dict[str, Any] | None:
        return get_json(self.cluster, self.namespace, f"kvp/{name}")

    def tenant_token(self, name: str, tenant: str = "default") -> str:
        return tenant_token(self.cluster, self.namespace, name, tenant)

    def agent_urls(self, name: str) -> dict[str, str]:
        """Pod name -> agent URL for the pool's pods with a running agent process."""
        assert self.harness is not None
        prefix = f"{self.namespace}/{name}-"
        return {
            key.split("/", 1)[1]: f"http://{proc.pod.pod_ip}:8000"
            for key, proc in self.harness.processes().items()
            if key.startswith(prefix) and proc.running()
        }

    def wait_agents_ready(self, name: str, replicas: int, timeout: float = 120) -> dict[str, str]:
        """Until exactly ``replicas`` agents of the pool answer /readyz."""

        def ready() -> dict[str, str] | None:
            self.check_operator()
            urls = self.agent_urls(name)
            if len(urls) == replicas and all(agent_ready(u) for u in urls.values()):
                return urls
            return None

        try:
            result: dict[str, str] = wait_until(
                f"{replicas} ready agents of {name}", ready, timeout, every=0.5
            )
        except AssertionError as err:
            raise AssertionError(f"{err}\n{self.agent_problems()}") from None
        return result

    def agent_problems(self) -> str:
        """The harness's account of agents that could not start or exited, or a note that
        there was none (for failure messages and ``serve``'s output)."""
        found = self.harness.problems() if self.harness is not None else []
        return "\n".join(found) if found else "no agent failed to start or exited"


@dataclass(frozen=True)
class Tick:
    """One driven request: when it finished, its blocks, its hit blocks, whether it failed."""

    at: float
    blocks: int
    hits: int
    failed: bool


class Load:
    """A steady load: the trace driven through a pool's ready agents, round after round, in a
    thread. Agents are looked up again every ``chunk`` requests, as a router following the
    pool's endpoints would, so scaling and rolling show up in where requests go. ``rate``
    paces the requests (per second) so that a round outlasts a pod swap."""

    def __init__(
        self, stack: Stack, name: str, trace: Trace, chunk: int = 50, rate: float | None = None
    ) -> None:
        self.stack, self.name, self.trace, self.chunk = stack, name, trace, chunk
        self.rate = rate
        self.ticks: list[Tick] = []
        self.rounds: list[tuple[float, float, DriveResult]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def __enter__(self) -> Load:
        self._thread = threading.Thread(target=self._run, name="load", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=120)

    def _urls(self) -> list[str]:
        return [u for u in self.stack.agent_urls(self.name).values() if agent_ready(u)]

    def _run(self) -> None:
        from kvpool_agent.client import PoolClient
        from kvpool_agent.drive import drive

        try:
            while not self._stop.is_set():
                start = time.monotonic()
                token = self.stack.tenant_token(self.name)
                total = DriveResult(trace=self.trace.name)
                for i in range(0, len(self.trace.requests), self.chunk):
                    urls = self._urls()
                    while not urls and not self._stop.wait(0.2):
                        urls = self._urls()
                    if self._stop.is_set():
                        return
                    part = Trace(
                        self.trace.name,
                        self.trace.block_size,
                        self.trace.requests[i : i + self.chunk],
                    )
                    http = httpx.Client(timeout=30.0, trust_env=False)
                    with PoolClient(urls, tokens_per_block=16, client=http, token=token) as client:
                        result = drive(
                            part,
                            client,
                            rate=self.rate,
                            on_request=self._record(),
                            should_stop=self._stop.is_set,
                        )
                    _accumulate(total, result)
                self.rounds.append((start, time.monotonic(), total))
        except BaseException as err:  # surfaced by the test through .error
            self.error = err

    def _record(self) -> Callable[[DriveResult], None]:
        seen = [0, 0, 0]

        def record(r: DriveResult) -> None:
            blocks, hits, failed = r.query_blocks - seen[0], r.hit_blocks - seen[1], r.failed
            self.ticks.append(Tick(time.monotonic(), blocks, hits, failed > seen[2]))
            seen[:] = [r.query_blocks, r.hit_blocks, failed]

        return record

    def hit_rate(self, start: float, end: float) -> float | None:
        """Block hit rate of the requests that finished in ``[start, end)``."""
        blocks = hits = 0
        for tick in list(self.ticks):
            if start <= tick.at < end:
                blocks, hits = blocks + tick.blocks, hits + tick.hits
        return hits / blocks if blocks else None

    def failures(self, start: float, end: float) -> int:
        return sum(1 for t in list(self.ticks) if start <= t.at < end and t.failed)

    def wait_rounds(self, count: int, timeout: float = 120) -> list[DriveResult]:
        """Until ``count`` more rounds finished; returns them."""
        have = len(self.rounds)
        wait_until(
            f"{count} load rounds", lambda: len(self.rounds) >= have + count or self.error, timeout
        )
        if self.error is not None:
            raise AssertionError(f"the load failed: {self.error!r}")
        return [r for _, _, r in self.rounds[have : have + count]]


def _accumulate(total: DriveResult, part: DriveResult) -> None:
    total.requests += part.requests
    total.failed += part.failed
    total.query_blocks += part.query_blocks
    total.hit_blocks += part.hit_blocks
    total.query_tokens += part.query_tokens
    total.hit_tokens += part.hit_tokens
    total.seconds += part.seconds
    total.per_replica.update(part.per_replica)
    total.errors.extend(part.errors)


def serve(args: argparse.Namespace) -> int:
    """Run the stack against a cluster started by ``kvpool dev-cluster up`` until a signal."""
    cluster = DevCluster.attach(Path(args.cluster_dir))
    stack = Stack(cluster, args.namespace, Path(args.workdir), timer_interval=args.timer_interval)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stack.start()
    try:
        print(
            json.dumps({"ready": True, "credential": stack.credential, **stack.timings}),
            flush=True,
        )
        reported: set[str] = set()
        while not stop.wait(1):
            stack.check_operator()
            if stack.harness is not None:
                for problem in stack.harness.problems():
                    first = problem.splitlines()[0]
                    if first not in reported:  # once each, on the demo's output
                        reported.add(first)
                        print(json.dumps({"agent_problem": problem}), flush=True)
    finally:
        stack.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run kvpool's local stack on a dev cluster.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="helm install, operator, agents; until SIGTERM")
    p.add_argument("--cluster-dir", required=True, help="the dev cluster's state dir")
    p.add_argument("--namespace", default="default", help="namespace of the pools")
    p.add_argument("--workdir", required=True, help="logs, kubeconfig, per-pod files")
    p.add_argument("--timer-interval", type=float, default=2.0)
    args = parser.parse_args(argv)
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
