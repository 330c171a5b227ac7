"""Run a real local process for every Running pod of the dev cluster.

kwok marks pods Running without running anything. To test the operator against real agents,
this harness watches pods and, for each Running pod whose IP is in 127.0.0.0/8, starts a
command bound to that IP (``{pod_ip}`` in the template); it stops the process when the pod is
deleted, stops running or changes IP. The command is a callable so tests can plug in any
program (the tests' loopback kubelet runs ``kvpool agent`` for each pool pod).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool_dev.cluster import set_parent_death_signal


@dataclass(frozen=True)
class PodInfo:
    """The facts about a pod a command template may use."""

    namespace: str
    name: str
    uid: str
    pod_ip: str
    node_name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    ports: tuple[int, ...] = ()
    """The pod's declared container ports, in spec order."""

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def template_fields(self) -> dict[str, str]:
        return {
            "pod_ip": self.pod_ip,
            "name": self.name,
            "namespace": self.namespace,
            "uid": self.uid,
            "node_name": self.node_name,
            "port": str(self.ports[0]) if self.ports else "",
        }


CommandFactory = Callable[[PodInfo], Sequence[str] | None]
"""Returns the argv to run for a pod, or None to leave that pod alone."""


def command_template(
    template: Sequence[str], selector: Callable[[PodInfo], bool] | None = None
) -> CommandFactory:
    """A factory formatting each argument with ``{pod_ip}``, ``{port}`` (the first declared
    container port), ``{name}``, ``{namespace}``, ``{uid}`` and ``{node_name}``;
    ``selector`` limits it to some pods."""

    def factory(pod: PodInfo) -> Sequence[str] | None:
        if selector is not None and not selector(pod):
            return None
        fields = pod.template_fields()
        return [arg.format(**fields) for arg in template]

    return factory


@dataclass
class AgentProcess:
    """One running (or finished) process started for a pod."""

    pod: PodInfo
    argv: list[str]
    popen: subprocess.Popen[bytes]
    log_path: Path
    started_at: float = field(default_factory=time.monotonic)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def running(self) -> bool:
        return self.popen.poll() is None

    def terminate(self, grace_s: float) -> int | None:
        """SIGTERM the process group, SIGKILL after ``grace_s``; returns the exit code."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout=5)
        return self.popen.returncode


def pod_info(pod: Any) -> PodInfo | None:
    """The PodInfo of a Running, not-terminating pod with a loopback IP, else None."""
    meta, status = pod.metadata, pod.status
    if meta is None or status is None or meta.deletion_timestamp is not None:
        return None
    if status.phase != "Running" or not status.pod_ip:
        return None
    try:
        if not ipaddress.ip_address(status.pod_ip).is_loopback:
            return None
    except ValueError:
        return None
    return PodInfo(
        namespace=meta.namespace,
        name=meta.name,
        uid=meta.uid,
        pod_ip=status.pod_ip,
        node_name=(pod.spec.node_name if pod.spec else "") or "",
        labels=dict(meta.labels or {}),
        annotations=dict(meta.annotations or {}),
        ports=tuple(
            port.container_port
            for container in (pod.spec.containers if pod.spec else None) or []
            for port in container.ports or []
        ),
    )


class PodAgentHarness:
    """Watches pods (list + watch, relist on errors) and keeps one process per eligible pod.

    A process that exits on its own is not restarted; it stays listed (``running()`` is
    False) until its pod goes, like a container that crashed under ``restartPolicy: Never``.
    Processes are started from the watch thread with a parent-death signal, so they never
    outlive the harness.

    ``namespace=None`` watches all namespaces; ``label_selector`` narrows the pods. Use as a
    context manager or call ``start()``/``stop()``.
    """

    def __init__(
        self,
        kubeconfig: Path,
        command: CommandFactory,
        log_dir: Path,
        namespace: str | None = None,
        label_selector: str | None = None,
        env: Mapping[str, str] | None = None,
        grace_s: float = 5.0,
        watch_timeout_s: int = 5,
    ) -> None:
        self.kubeconfig = kubeconfig
        self.command = command
        self.log_dir = log_dir
        self.namespace = namespace
        self.label_selector = label_selector
        self.env = dict(env or {})
        self.grace_s = grace_s
        self.watch_timeout_s = watch_timeout_s
        self._procs: dict[str, AgentProcess] = {}
        """Pod uid -> its process."""
        self._finished: list[AgentProcess] = []
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []
        self._spawn_failures: dict[str, str] = {}
        """Pod uid -> why its command could not be started (retried on the next event)."""

    def __enter__(self) -> PodAgentHarness:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._loop, name="pod-agents", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching and terminate every process."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.watch_timeout_s + 10)
        with self._cond:
            for uid in list(self._procs):
                self._stop_uid(uid)
            self._cond.notify_all()

    # -- queries ----------------------------------------------------------------------------

    def processes(self) -> dict[str, AgentProcess]:
        """The process of every current pod, keyed by ``namespace/name`` (one that exited on
        its own stays here with ``running()`` False until its pod goes)."""
        with self._cond:
            return {p.pod.key: p for p in self._procs.values()}

    def finished(self) -> list[AgentProcess]:
        """Processes that were stopped or exited, oldest first."""
        with self._cond:
            return list(self._finished)

    def problems(self, tail_lines: int = 20) -> list[str]:
        """What went wrong with the pods' agents, for a person to read: commands that could
        not be started, and processes that exited on their own (exit code and log tail)."""
        with self._cond:
            out = list(self._spawn_failures.values())
            exited = [p for p in self._procs.values() if not p.running()]
        for proc in exited:
            try:
                lines = proc.log_path.read_text(errors="replace").splitlines()[-tail_lines:]
            except OSError:
                lines = []
            tail = "\n    ".join(lines) if lines else "(empty log)"
            out.append(
                f"pod {proc.pod.key}: agent exited with code {proc.popen.returncode} "
                f"({' '.join(proc.argv)}); last log lines:\n    {tail}"
            )
        return out

    def wait_for(self, key: str, timeout: float = 60) -> AgentProcess:
        """Block until a process runs for pod ``namespace/name``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for proc in self._procs.values():
                    if proc.pod.key == key:
                        return proc
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no process started for pod {key} in {timeout}s")
                self._cond.wait(left)

    def wait_gone(self, key: str, timeout: float = 60) -> None:
        """Block until no process runs for pod ``namespace/name``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while any(p.pod.key == key for p in self._procs.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"process for pod {key} still running after {timeout}s")
                self._cond.wait(left)

    # -- reconcile --------------------------------------------------------------------------

    def _loop(self) -> None:
        from kubernetes import client, config, watch
        from kubernetes.client.exceptions import ApiException

        api_client = config.new_client_from_config(config_file=str(self.kubeconfig))
        core = client.CoreV1Api(api_client)
        kwargs: dict[str, Any] = {}
        if self.label_selector:
            kwargs["label_selector"] = self.label_selector
        if self.namespace:
            lister: Callable[..., Any] = core.list_namespaced_pod
            kwargs["namespace"] = self.namespace
        else:
            lister = core.list_pod_for_all_namespaces
        try:
            while not self._stop.is_set():
                try:
                    listing = lister(**kwargs)
                    self._resync(listing.items)
                    version = listing.metadata.resource_version
                    while not self._stop.is_set():
                        w = watch.Watch()
                        for event in w.stream(
                            lister,
                            resource_version=version,
                            timeout_seconds=self.watch_timeout_s,
                            allow_watch_bookmarks=True,
                            **kwargs,
                        ):
                            obj = event["object"]
                            version = obj.metadata.resource_version
                            if event["type"] == "BOOKMARK":
                                continue
                            self._reconcile_pod(obj, deleted=event["type"] == "DELETED")
                            if self._stop.is_set():
                                w.stop()
                except ApiException as err:
                    if err.status != 410:
                        self.errors.append(f"pod watch: {err.status} {err.reason}")
                        self._stop.wait(1)
                except Exception as err:  # keep watching through transient API errors
                    self.errors.append(f"pod watch: {err!r}")
                    self._stop.wait(1)
        finally:
            # Terminate from this thread: its exit fires the children's parent-death SIGKILL,
            # so doing it after the join would skip the graceful SIGTERM.
            with self._cond:
                for uid in list(self._procs):
                    self._stop_uid(uid)
                self._cond.notify_all()
            api_client.close()

    def _resync(self, pods: Sequence[Any]) -> None:
        seen = set()
        for pod in pods:
            seen.add(pod.metadata.uid)
            self._reconcile_pod(pod, deleted=False)
        with self._cond:
            for uid in [u for u in self._procs if u not in seen]:
                self._stop_uid(uid)
            self._cond.notify_all()

    def _reconcile_pod(self, pod: Any, deleted: bool) -> None:
        uid = pod.metadata.uid
        info = None if deleted else pod_info(pod)
        with self._cond:
            current = self._procs.get(uid)
            if current is not None and (info is None or info.pod_ip != current.pod.pod_ip):
                self._stop_uid(uid)
                current = None
            if info is not None and current is None:
                argv = self.command(info)
                if argv is not None:
                    try:
                        self._procs[uid] = self._spawn(info, list(argv))
                        self._spawn_failures.pop(uid, None)
                    except OSError as err:
                        self._spawn_failures[uid] = (
                            f"pod {info.key}: cannot start {argv[0]!r}: {err.strerror or err}"
                        )
            if deleted:
                self._spawn_failures.pop(uid, None)
            self._cond.notify_all()

    def _spawn(self, pod: PodInfo, argv: list[str]) -> AgentProcess:
        log_path = self.log_dir / f"{pod.namespace}_{pod.name}_{pod.uid[:8]}.log"
        env = {
            **os.environ,
            **self.env,
            "POD_IP": pod.pod_ip,
            "POD_NAME": pod.name,
            "POD_NAMESPACE": pod.namespace,
            "NODE_NAME": pod.node_name,
        }
        with log_path.open("ab") as log:
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=set_parent_death_signal,
            )
        return AgentProcess(pod=pod, argv=argv, popen=popen, log_path=log_path)

    def _stop_uid(self, uid: str) -> None:
        """Caller holds the lock."""
        proc = self._procs.pop(uid)
        proc.terminate(self.grace_s)
        self._finished.append(proc)
