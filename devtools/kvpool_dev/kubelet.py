"""The kubelet's part for agent pods on the loopback dev cluster, and cluster DNS for the
pods' stable names (used by ``kvpool_dev.stack``).

- ``LoopbackKubelet``: a ``CommandFactory`` for ``PodAgentHarness`` (kwok marks pods Running
  with a 127.x IP and runs nothing). It projects each pod's ConfigMap and Secret volumes into
  a per-pod directory (kept in sync every second, as kubelet does, so live config edits and
  rotated credentials reach the running agent), rewrites the mount paths in the command line
  and in the projected config (the agent's credential files), and runs the readiness probe
  kwok does not: a pod is Ready only while its agent answers ``/readyz``.
- ``PeerProxies``: the operator lists the pool's pods as handoff peers by their StatefulSet
  DNS names (``pool-0.pool.ns.svc``); each such name gets a fixed 127.0.0.1 port that
  forwards to the pod's current IP, and the projected config names that port, so a warm
  handoff reaches whichever pod holds the name now.
"""

from __future__ import annotations

import base64
import datetime
import http.server
import os
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvpool_dev.podagents import PodInfo
from kvpool_dev.poll import DIRECT, agent_ready

AGENT_SELECTOR = "app.kubernetes.io/name=kvpool-agent"


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
            with DIRECT.open(req, timeout=60) as resp:
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
                    text = project_agent_config(text, files.rewrites, files.pod.name, self.proxies)
                _write_if_changed(mount.local_dir / name, text)

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


def project_agent_config(
    text: str, rewrites: dict[str, str], pod: str, proxies: PeerProxies
) -> str:
    """An agent config file as ``pod`` sees it: handoff peers' DNS names -> their
    ``PeerProxies`` URLs, and paths under a mount (the credential files) -> the pod's local
    directories; other files as they are.

    The proxy URLs are then the agents' ring (``lifecycle.ring_aware``), so each agent is
    told its own (``lifecycle.self_url``: the peer named after ``pod``), which it would
    otherwise find from ``POD_NAME`` in the DNS name. Clients rank the same proxy URLs
    (``Stack.ring``) and connect to the pods' IPs."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if not isinstance(doc, dict):
        return text
    translated = _rewrite_paths(doc, rewrites)
    lifecycle = translated.get("lifecycle")
    if isinstance(lifecycle, dict) and lifecycle.get("handoff_peers"):
        peers = [str(p) for p in lifecycle["handoff_peers"]]
        lifecycle["handoff_peers"] = [proxies.translate(p) for p in peers]
        own = [p for p in peers if (urllib.parse.urlsplit(p).hostname or "").startswith(f"{pod}.")]
        if own and not lifecycle.get("self_url"):
            lifecycle["self_url"] = proxies.translate(own[0])
    if translated == doc:
        return text
    return yaml.safe_dump(translated, sort_keys=False)


def container_argv(argv: Sequence[str], rewrites: dict[str, str]) -> list[str]:
    """The local command line of a container's ``command + args``: its pod paths rewritten to
    the pod's local directories, and ``kvpool`` run as this interpreter's module. Only the
    container's own arguments are rewritten: the interpreter and the project may live
    anywhere, a clone under /tmp included, while /tmp is also a pod volume."""
    out = [_rewrite(arg, rewrites) for arg in argv]
    if out and out[0] == "kvpool":
        out = [sys.executable, "-m", "kvpool_cli", *out[1:]]
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
