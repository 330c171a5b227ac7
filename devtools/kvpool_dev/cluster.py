"""Start and stop a real control plane on loopback: etcd, kube-apiserver, controller-manager,
scheduler and kwok as the kubelet of fake GPU nodes.

Every process gets its own free 127.0.0.1 port, so several clusters (parallel test sessions,
CI) coexist. Everything a later ``down`` needs is written to ``<state dir>/state.json`` (pids
and the binaries they run); each process leads its own process group so a stop reaches its
children too.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import itertools
import json
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, cast

from kvpool_dev import certs
from kvpool_dev.build import BuildLayout

SERVICE_CIDR = "10.96.0.0/24"
SERVICE_IP = "10.96.0.1"
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
GPU_RESOURCE = "nvidia.com/gpu"
STOP_ORDER = ("kwok", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd")


class ClusterError(RuntimeError):
    """The cluster did not come up; the message names the component and its log file."""


@dataclass(frozen=True)
class GpuNodeSpec:
    """One fake node as the scheduler sees it: GPUs plus generous CPU/memory."""

    name: str
    gpus: int = 8
    cpu: str = "64"
    memory: str = "512Gi"
    pods: int = 110
    gpu_product: str = "NVIDIA-H100-80GB-HBM3"
    labels: Mapping[str, str] = field(default_factory=dict)

    def manifest(self, pod_cidr: str = "") -> dict[str, Any]:
        """The Node object, status included: kwok keeps the capacity we create it with.

        ``pod_cidr`` must differ per node: kwok hands out pod IPs per node from it, and
        nodes without one would hand out the same addresses.
        """
        capacity = {
            "cpu": self.cpu,
            "memory": self.memory,
            "pods": str(self.pods),
            GPU_RESOURCE: str(self.gpus),
        }
        labels = {
            "kubernetes.io/hostname": self.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "type": "kwok",
            "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.product": self.gpu_product,
            "nvidia.com/gpu.count": str(self.gpus),
            **self.labels,
        }
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.name,
                "labels": labels,
                "annotations": {KWOK_ANNOTATION: "fake"},
            },
            "spec": {"podCIDR": pod_cidr, "podCIDRs": [pod_cidr]} if pod_cidr else {},
            "status": {"capacity": capacity, "allocatable": dict(capacity)},
        }


@dataclass(frozen=True)
class ClusterConfig:
    """What to start. ``pod_cidr`` must lie in 127.0.0.0/8 so pod IPs are bindable locally."""

    state_dir: Path
    name: str = "kvpool-dev"
    gpu_nodes: tuple[GpuNodeSpec, ...] = (GpuNodeSpec("gpu-node-0"), GpuNodeSpec("gpu-node-1"))
    pod_cidr: str = ""
    die_with_parent: bool = False
    """Kill the components when the starting process dies (test fixtures); off for ``up``."""
    ready_timeout_s: float = 120.0

    def resolved_pod_cidr(self) -> str:
        """A random 127.N.0.0/16 unless given, so concurrent clusters get disjoint pod IPs."""
        if self.pod_cidr:
            try:
                net = ipaddress.IPv4Network(self.pod_cidr)
            except ValueError as err:
                raise ClusterError(f"pod_cidr {self.pod_cidr!r}: {err}") from None
            if not net.subnet_of(ipaddress.IPv4Network("127.0.0.0/8")) or net.prefixlen > 23:
                raise ClusterError(
                    f"pod_cidr {self.pod_cidr!r} must lie in 127.0.0.0/8 and hold at least two /24s"
                )
            return self.pod_cidr
        return f"127.{random.randint(16, 250)}.0.0/16"


@dataclass
class ClusterState:
    """The persisted facts about a running cluster (``state.json``)."""

    name: str
    state_dir: str
    bin_dir: str
    server: str
    kubeconfig: str
    pod_cidr: str
    ports: dict[str, int]
    pids: dict[str, int]
    started_at: float
    node_cidrs: dict[str, str] = field(default_factory=dict)
    """Node name -> its pod CIDR, a /24 of ``pod_cidr``."""

    def next_node_cidr(self) -> str:
        """The first /24 of ``pod_cidr`` that no node has yet (skipping x.x.0.0/24)."""
        used = set(self.node_cidrs.values())
        net = ipaddress.ip_network(self.pod_cidr)
        for subnet in itertools.islice(net.subnets(new_prefix=24), 1, None):
            if str(subnet) not in used:
                return str(subnet)
        raise ClusterError(f"pod CIDR {self.pod_cidr} has no free /24 left for another node")

    @classmethod
    def load(cls, state_dir: Path) -> ClusterState:
        path = state_dir / "state.json"
        if not path.is_file():
            raise ClusterError(f"no cluster state at {path}")
        return cls(**json.loads(path.read_text()))

    def save(self) -> None:
        path = Path(self.state_dir) / "state.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        tmp.replace(path)


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports the kernel considers free now (all held while picking)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


def set_parent_death_signal() -> None:
    """``preexec_fn``: ask the kernel to SIGKILL the child when its parent thread exits."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)


def _http_get(url: str, context: ssl.SSLContext | None, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, context=context, timeout=timeout) as resp:
            return int(resp.status), resp.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        return int(err.code), err.read().decode(errors="replace")


def _pid_runs(pid: int, binary: str) -> bool:
    """True when ``pid`` is alive and still runs ``binary`` (guards against reused pids)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return bool(cmdline) and cmdline[0].decode(errors="replace") == binary


def process_alive(state: ClusterState, name: str) -> bool:
    """Whether component ``name`` of a cluster still runs."""
    pid = state.pids.get(name)
    return pid is not None and _pid_runs(pid, str(Path(state.bin_dir) / name))


def stop_processes(state: ClusterState, grace_s: float = 10.0) -> list[str]:
    """SIGTERM every component's process group (kwok first, etcd last), then SIGKILL."""
    stopped: list[str] = []
    names = [n for n in STOP_ORDER if n in state.pids] + [
        n for n in state.pids if n not in STOP_ORDER
    ]
    for name in names:
        pid = state.pids[name]
        binary = str(Path(state.bin_dir) / name)
        if not _pid_runs(pid, binary):
            continue
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and _pid_runs(pid, binary):
            _reap(pid)
            time.sleep(0.05)
        if _pid_runs(pid, binary):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        _reap(pid)
        stopped.append(name)
    return stopped


def _reap(pid: int) -> None:
    """Collect a child's exit status if it is ours, so it does not linger as a zombie."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


class DevCluster:
    """A running (or about to run) loopback control plane.

    Use as a context manager, or call ``start()``/``stop()``; ``DevCluster.attach(dir)`` gives
    a handle on a cluster that ``kvpool-dev cluster up`` started earlier.
    """

    def __init__(self, config: ClusterConfig, layout: BuildLayout) -> None:
        self.config = config
        self.layout = layout
        self.state_dir = config.state_dir.resolve()
        self.pki = certs.PkiPaths(self.state_dir / "pki")
        self.state: ClusterState | None = None
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    # -- paths ------------------------------------------------------------------------------

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig (system:masters)."""
        return self.state_dir / "admin.kubeconfig"

    @property
    def bin_dir(self) -> Path:
        """Where the binaries come from (a cluster attached from state.json keeps its own)."""
        return Path(self.state.bin_dir) if self.state is not None else self.layout.bin_dir

    def log_file(self, component: str) -> Path:
        return self.state_dir / "logs" / f"{component}.log"

    @property
    def server(self) -> str:
        return self._state().server

    @property
    def pod_cidr(self) -> str:
        return self._state().pod_cidr

    def _state(self) -> ClusterState:
        if self.state is None:
            raise ClusterError("the cluster is not started")
        return self.state

    @classmethod
    def attach(cls, state_dir: Path) -> DevCluster:
        """A handle on a cluster started by another process, from its state.json."""
        state = ClusterState.load(state_dir)
        config = ClusterConfig(state_dir=Path(state.state_dir), name=state.name)
        cluster = cls(config, BuildLayout())
        cluster.state = state
        return cluster

    # -- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> DevCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> DevCluster:
        """Generate certs, start all components, create the fake GPU nodes, wait for Ready.

        Call it from a long-lived thread when ``die_with_parent`` is set: the kernel kills
        the components when the thread that started them exits.
        """
        if not self.layout.is_built():
            raise ClusterError(
                f"binaries missing in {self.layout.bin_dir}; run `kvpool-dev cluster build`"
            )
        if (self.state_dir / "state.json").is_file():
            old = ClusterState.load(self.state_dir)
            if any(_pid_runs(p, str(Path(old.bin_dir) / n)) for n, p in old.pids.items()):
                raise ClusterError(f"a cluster is already running from {self.state_dir}")
        # Every start is a fresh cluster: old etcd data would hold nodes and certs that no
        # longer match (e.g. after the previous run was killed).
        shutil.rmtree(self.state_dir / "etcd", ignore_errors=True)
        (self.state_dir / "logs").mkdir(parents=True, exist_ok=True)
        certs.generate_pki(self.pki, SERVICE_IP)
        names = ("etcd", "etcd-peer", "apiserver", "controller-manager", "scheduler", "kwok")
        ports = dict(zip(names, free_ports(len(names)), strict=True))
        server = f"https://127.0.0.1:{ports['apiserver']}"
        for who in certs.CLIENTS:
            certs.write_kubeconfig(
                self._kubeconfig_for(who), server, self.pki, who, self.config.name
            )
        self.state = ClusterState(
            name=self.config.name,
            state_dir=str(self.state_dir),
            bin_dir=str(self.bin_dir),
            server=server,
            kubeconfig=str(self.kubeconfig),
            pod_cidr=self.config.resolved_pod_cidr(),
            ports=ports,
            pids={},
            started_at=time.time(),
        )
        try:
            self._start_etcd()
            self._start_apiserver()
            self._start_controller_manager()
            self._start_scheduler()
            self._wait_healthy("kube-controller-manager", ports["controller-manager"])
            self._wait_healthy("kube-scheduler", ports["scheduler"])
            self._start_kwok()
            for node in self.config.gpu_nodes:
                self.add_node(node)
            self.wait_nodes_ready([n.name for n in self.config.gpu_nodes])
            self.wait_service_account("default")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every component (idempotent); logs and certs stay in the state dir."""
        if self.state is None:
            return
        stop_processes(self.state)
        for proc in self._procs.values():
            with contextlib.suppress(Exception):
                proc.wait(timeout=5)
        self._procs.clear()
        self.state.pids = {}
        self.state.save()

    def _kubeconfig_for(self, who: certs.ClientIdentity) -> Path:
        if who is certs.ADMIN:
            return self.kubeconfig
        return self.state_dir / f"{who.file_stem}.kubeconfig"

    def _spawn(self, name: str, args: Sequence[str]) -> None:
        state = self._state()
        binary = str(self.bin_dir / name)
        log = self.log_file(name).open("ab")
        proc = subprocess.Popen(
            [binary, *args],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.state_dir,
            start_new_session=True,
            preexec_fn=set_parent_death_signal if self.config.die_with_parent else None,
        )
        log.close()
        self._procs[name] = proc
        state.pids[name] = proc.pid
        state.save()

    def _check_alive(self, name: str) -> None:
        proc = self._procs.get(name)
        if proc is not None and proc.poll() is not None:
            tail = self.log_file(name).read_text(errors="replace")[-3000:]
            raise ClusterError(
                f"{name} exited with {proc.returncode}; log {self.log_file(name)}:\n{tail}"
            )

    def _wait(self, name: str, probe: Callable[[], bool], timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout or self.config.ready_timeout_s)
        while True:
            self._check_alive(name)
            with contextlib.suppress(OSError, ValueError):
                if probe():
                    return
            if time.monotonic() > deadline:
                raise ClusterError(f"{name} not ready in time; see {self.log_file(name)}")
            time.sleep(0.2)

    # -- components -------------------------------------------------------------------------

    def _start_etcd(self) -> None:
        ports = self._state().ports
        client = f"http://127.0.0.1:{ports['etcd']}"
        peer = f"http://127.0.0.1:{ports['etcd-peer']}"
        self._spawn(
            "etcd",
            [
                "--name=default",
                f"--data-dir={self.state_dir / 'etcd'}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=default={peer}",
                "--listen-metrics-urls=",
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
        )
        self._wait("etcd", lambda: '"health":"true"' in _http_get(f"{client}/health", None)[1])

    def _admin_ssl(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki.ca_cert))
        ctx.load_cert_chain(
            str(self.pki.client_cert(certs.ADMIN)), str(self.pki.client_key(certs.ADMIN))
        )
        return ctx

    def _start_apiserver(self) -> None:
        st = self._state()
        pki = self.pki
        self._spawn(
            "kube-apiserver",
            [
                f"--etcd-servers=http://127.0.0.1:{st.ports['etcd']}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={st.ports['apiserver']}",
                f"--cert-dir={self.state_dir / 'apiserver-certs'}",
                f"--tls-cert-file={pki.apiserver_cert}",
                f"--tls-private-key-file={pki.apiserver_key}",
                f"--client-ca-file={pki.ca_cert}",
                # Front-proxy settings: without them every component logs a missing CA bundle.
                f"--requestheader-client-ca-file={pki.ca_cert}",
                "--requestheader-allowed-names=front-proxy-client",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--service-account-key-file={pki.sa_pub}",
                f"--service-account-signing-key-file={pki.sa_key}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=Node,RBAC",
                "--allow-privileged=true",
                # Endpoints on 127.0.0.1 are invalid for the `kubernetes` Service; skip them.
                "--endpoint-reconciler-type=none",
                "--profiling=false",
                "--v=0",
            ],
        )
        url = f"{st.server}/readyz"
        ctx = self._admin_ssl()
        self._wait("kube-apiserver", lambda: _http_get(url, ctx)[0] == 200)

    def _component_auth_flags(self, who: certs.ClientIdentity, port: int, name: str) -> list[str]:
        kubeconfig = self._kubeconfig_for(who)
        return [
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            f"--cert-dir={self.state_dir / (name + '-certs')}",
            "--leader-elect=false",
            "--profiling=false",
        ]

    def _start_controller_manager(self) -> None:
        st = self._state()
        self._spawn(
            "kube-controller-manager",
            [
                *self._component_auth_flags(
                    certs.CONTROLLER_MANAGER, st.ports["controller-manager"], "controller-manager"
                ),
                "--controllers=*",
                "--use-service-account-credentials=true",
                f"--root-ca-file={self.pki.ca_cert}",
                f"--service-account-private-key-file={self.pki.sa_key}",
                f"--cluster-signing-cert-file={self.pki.ca_cert}",
                f"--cluster-signing-key-file={self.pki.ca_key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--cluster-name=" + self.config.name,
            ],
        )

    def _start_scheduler(self) -> None:
        st = self._state()
        self._spawn(
            "kube-scheduler",
            self._component_auth_flags(certs.SCHEDULER, st.ports["scheduler"], "scheduler"),
        )

    def _wait_healthy(self, name: str, port: int) -> None:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE  # self-signed serving cert of a loopback component
        url = f"https://127.0.0.1:{port}/healthz"
        self._wait(name, lambda: _http_get(url, ctx)[0] == 200)

    def _start_kwok(self) -> None:
        st = self._state()
        stages = resources.files("kvpool_dev").joinpath("kwok-stages.yaml")
        stages_path = self.state_dir / "kwok-stages.yaml"
        stages_path.write_text(stages.read_text())
        self._spawn(
            "kwok",
            [
                f"--kubeconfig={self._kubeconfig_for(certs.KWOK)}",
                f"--config={stages_path}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}=fake",
                f"--cidr={st.pod_cidr}",
                "--node-ip=127.0.0.1",
                f"--server-address=127.0.0.1:{st.ports['kwok']}",
                "--node-lease-duration-seconds=40",
            ],
        )
        url = f"http://127.0.0.1:{st.ports['kwok']}/healthz"
        self._wait("kwok", lambda: _http_get(url, None)[0] == 200)

    # -- cluster objects --------------------------------------------------------------------

    def api_client(self) -> Any:
        """A ``kubernetes.client.ApiClient`` for the admin user (caller closes it)."""
        from kubernetes import config as k8s_config

        return k8s_config.new_client_from_config(config_file=str(self.kubeconfig))

    def add_node(self, node: GpuNodeSpec) -> None:
        """Create a fake GPU node that kwok manages."""
        from kubernetes import client

        state = self._state()
        cidr = state.next_node_cidr()
        with self.api_client() as api:
            client.CoreV1Api(api).create_node(cast(Any, node.manifest(cidr)))
        state.node_cidrs[node.name] = cidr
        state.save()

    def wait_nodes_ready(self, names: Sequence[str], timeout: float | None = None) -> None:
        from kubernetes import client

        def ready() -> bool:
            with self.api_client() as api:
                nodes = client.CoreV1Api(api).list_node().items
            ok = {
                n.metadata.name
                for n in nodes
                if n.metadata
                and n.status
                and any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or [])
            }
            return set(names) <= ok

        self._wait("kwok", ready, timeout)

    def wait_service_account(self, namespace: str, timeout: float | None = None) -> None:
        """Pods are admitted only once the controller-manager created the namespace's SA."""
        from kubernetes import client

        def exists() -> bool:
            with self.api_client() as api:
                sas = client.CoreV1Api(api).list_namespaced_service_account(namespace).items
            return any(sa.metadata and sa.metadata.name == "default" for sa in sas)

        self._wait("kube-controller-manager", exists, timeout)

    # -- tools ------------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """Environment for kubectl/helm: KUBECONFIG and the cached binaries first on PATH."""
        return {
            "KUBECONFIG": str(self.kubeconfig),
            "PATH": f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        }

    def _tool(self, tool: str, args: Sequence[str], check: bool, timeout: float) -> Any:
        env = {**os.environ, **self.env(), "HOME": str(self.state_dir)}
        env.setdefault("HELM_CACHE_HOME", str(self.state_dir / "helm" / "cache"))
        env.setdefault("HELM_CONFIG_HOME", str(self.state_dir / "helm" / "config"))
        env.setdefault("HELM_DATA_HOME", str(self.state_dir / "helm" / "data"))
        return subprocess.run(
            [str(self.bin_dir / tool), *args],
            env=env,
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout,
        )

    def kubectl(
        self, *args: str, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run the cached kubectl against this cluster."""
        result: subprocess.CompletedProcess[str] = self._tool("kubectl", args, check, timeout)
        return result

    def helm(
        self, *args: str, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """Run the cached helm against this cluster."""
        result: subprocess.CompletedProcess[str] = self._tool("helm", args, check, timeout)
        return result
