"""The user's whole stack on the loopback dev cluster: chart, operator, agents, traces.

Used by ``tests/e2e/test_user_story.py``, ``bench/e2e_timings.py`` and ``hack/demo``
(``kvpool-dev stack serve ...`` runs the stack in the foreground until a signal).

What a real cluster would do and the dev cluster does not, done here on loopback:

- ``helm install`` the chart, then run ``kvpool operator`` as a local process under the
  chart's ServiceAccount (a TokenRequest token, so the chart's RBAC is what it gets);
- the kubelet's part for agent pods: kwok marks them Running with a 127.x IP, and
  ``PodAgentHarness`` starts the container's command for each; ``kvpool_dev.kubelet``'s
  ``LoopbackKubelet`` projects their volumes and probes their readiness, and its
  ``PeerProxies`` stand for cluster DNS of the pods' stable names.

Agents authenticate (the operator's ``<pool>-auth`` Secret): whatever talks to them here
presents the token of the pool's ``default`` tenant, read from ``<pool>-tenant-default``
(``tenant_token``), as a client pod mounting that Secret would.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvpool_agent.drive import DriveResult
from kvpool_agent.replay.synth import SAMPLE_TRACE
from kvpool_agent.traces import Trace
from kvpool_dev.certs import issue_client_cert, service_account_identity
from kvpool_dev.cluster import DevCluster, set_parent_death_signal
from kvpool_dev.kubelet import AGENT_SELECTOR, LoopbackKubelet, PeerProxies
from kvpool_dev.podagents import PodAgentHarness
from kvpool_dev.poll import agent_ready, wait_until

REPO = Path(__file__).resolve().parents[2]
"""The repository (this package is installed editable from ``devtools/``)."""
CHART = REPO / "charts" / "kvpool"
EXAMPLES = REPO / "crds" / "examples"


# -- traces ---------------------------------------------------------------------------------


def story_trace() -> Path:
    """The workload of the story: the trace the repository ships (``kvpool trace synth``)."""
    return SAMPLE_TRACE


# -- what the cluster holds ------------------------------------------------------------------


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
        sys.executable, "-m", "kvpool_cli", "operator", "--standalone",
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

    def ring(self, urls: dict[str, str]) -> dict[str, str]:
        """``agent_urls``' pods by their names in the agents' ring (the ``PeerProxies`` URLs
        the projected configs name), each mapped to its agent URL: what a client ranks and
        where it connects (``PoolClient(ring, addresses=ring)``), so that prefixes keep
        their owner across a pod's restart at a new IP, as with StatefulSet DNS names."""
        return {self.proxies.url_for(self.namespace, pod, 8000): url for pod, url in urls.items()}

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

    def _urls(self) -> dict[str, str]:
        """Ready agents, by their names in the ring (``Stack.ring``)."""
        ready = {p: u for p, u in self.stack.agent_urls(self.name).items() if agent_ready(u)}
        return self.stack.ring(ready)

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
                    with PoolClient(
                        urls, tokens_per_block=16, client=http, token=token, addresses=urls
                    ) as client:
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


def serve(cluster_dir: Path, namespace: str, workdir: Path, timer_interval: float) -> int:
    """Run the stack against a cluster started by ``kvpool-dev cluster up`` until a signal;
    prints one JSON line ``{"ready": true, ...}``, then one ``{"agent_problem": ...}`` per
    agent that could not start or exited."""
    cluster = DevCluster.attach(cluster_dir)
    stack = Stack(cluster, namespace, workdir, timer_interval=timer_interval)
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
