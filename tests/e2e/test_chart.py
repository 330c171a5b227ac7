"""The Helm chart against the real API server of the dev cluster.

``helm lint`` catches template and schema mistakes; the API server catches the rest: every
manifest the chart renders goes through ``kubectl apply --dry-run=server`` (admission,
schema and RBAC checks of a real kube-apiserver). Then the chart is installed, and the
operator is run under the chart's own service account and Role, so a missing RBAC rule
shows up as a pool whose children never appear.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpool_dev.certs import issue_client_cert, service_account_identity
from kvpool_dev.cluster import DevCluster
from kvpool_dev.poll import wait_until

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvpool"
CHART_CRDS = CHART / "crds"
SERVICE_MONITOR_CRD = REPO / "tests" / "chart" / "fixtures" / "servicemonitor-crd.yaml"
PEERING_CRDS = ("clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev")


def write_values(tmp_path: Path, values: dict[str, Any]) -> Path:
    path = tmp_path / f"values-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def release_name() -> str:
    return f"kvp-{uuid.uuid4().hex[:6]}"


def render(
    cluster: DevCluster, tmp_path: Path, namespace: str, values: dict[str, Any]
) -> list[dict[str, Any]]:
    out = cluster.helm(
        "template",
        release_name(),
        str(CHART),
        "--namespace",
        namespace,
        "-f",
        str(write_values(tmp_path, values)),
    )
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def get_json(cluster: DevCluster, *args: str) -> dict[str, Any] | None:
    out = cluster.kubectl("get", *args, "-o", "json", check=False)
    if out.returncode != 0:
        return None
    loaded: dict[str, Any] = json.loads(out.stdout)
    return loaded


def exists(cluster: DevCluster, kind: str, name: str, namespace: str) -> Callable[[], bool]:
    return lambda: get_json(cluster, kind, name, "-n", namespace) is not None


def wait_established(cluster: DevCluster, *crds: str) -> None:
    cluster.kubectl(
        "wait", "--for=condition=Established", *(f"crd/{c}" for c in crds), "--timeout=60s"
    )


@pytest.fixture(scope="module")
def crds(dev_cluster: DevCluster) -> Iterator[DevCluster]:
    """The chart's CRDs and the ServiceMonitor stand-in, applied as the README says."""
    dev_cluster.kubectl(
        "apply", "--server-side", "--force-conflicts", "-f", str(CHART_CRDS), "-f",
        str(SERVICE_MONITOR_CRD),
    )  # fmt: skip
    wait_established(
        dev_cluster,
        "kvcachepools.kvpool.io",
        *PEERING_CRDS,
        "servicemonitors.monitoring.coreos.com",
    )
    yield dev_cluster
    # Only this module uses these: leave the other e2e tests the cluster they expect.
    dev_cluster.kubectl(
        "delete", "crd", "servicemonitors.monitoring.coreos.com", *PEERING_CRDS,
        "--ignore-not-found", "--wait=false", check=False,
    )  # fmt: skip


@pytest.fixture
def other_namespace(dev_cluster: DevCluster) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    dev_cluster.kubectl("create", "namespace", name)
    yield name
    dev_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


# -- helm lint ----------------------------------------------------------------------------

ALL_OPTIONS: dict[str, Any] = {
    "operator": {
        "replicas": 2,
        "watchNamespaces": ["team-a", "team-b"],
        "peering": {"enabled": True, "name": "kvpool-team"},
        "verbose": True,
        "extraEnv": [{"name": "EXTRA", "value": "1"}],
        "metrics": {"enabled": True, "port": 9102, "from": [{"podSelector": {}}]},
    },
    "rbac": {"serviceMonitors": True},
    "podDisruptionBudget": {"enabled": True, "minAvailable": 1},
    "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
    "imagePullSecrets": [{"name": "registry"}],
    "priorityClassName": "system-cluster-critical",
}


@pytest.mark.parametrize("values", [{}, ALL_OPTIONS], ids=["defaults", "all-options"])
def test_helm_lint_is_clean(
    dev_cluster: DevCluster, tmp_path: Path, values: dict[str, Any]
) -> None:
    out = dev_cluster.helm(
        "lint", "--strict", str(CHART), "-f", str(write_values(tmp_path, values)), check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout
    assert "[WARNING]" not in out.stdout and "[ERROR]" not in out.stdout


# -- every rendered manifest through the real API server -----------------------------------


def _namespaced_values(ns: str, other: str) -> dict[str, Any]:
    values = json.loads(json.dumps(ALL_OPTIONS))
    values["operator"]["watchNamespaces"] = [ns, other]
    return values


CASES: dict[str, tuple[Callable[[str, str], dict[str, Any]], dict[str, int]]] = {
    "defaults": (
        lambda ns, other: {},
        {
            "ServiceAccount": 1,
            "Role": 1,  # the release's namespace only
            "RoleBinding": 1,
            "ClusterRole": 1,  # kopf scanning (CRDs, namespaces), read-only
            "ClusterRoleBinding": 1,
            "Deployment": 1,
            "NetworkPolicy": 1,
        },
    ),
    "namespaced-everything": (
        _namespaced_values,
        {
            "ServiceAccount": 1,
            "Role": 2,
            "RoleBinding": 2,
            "ClusterRole": 1,  # kopf scanning (CRDs, namespaces), read-only
            "ClusterRoleBinding": 1,
            "Deployment": 1,
            "KopfPeering": 2,
            "PodDisruptionBudget": 1,
            "ServiceMonitor": 1,
            "NetworkPolicy": 1,
        },
    ),
    "clusterwide-peering-own-sa": (
        lambda ns, other: {
            "operator": {"clusterWide": True, "peering": {"enabled": True}},
            "networkPolicy": {"enabled": False},
            "serviceAccount": {"create": False, "name": "existing-sa"},
            "rbac": {"kopfScanning": False},
            "podDisruptionBudget": {"enabled": True, "maxUnavailable": "50%"},
        },
        {
            "ClusterRole": 1,
            "ClusterRoleBinding": 1,
            "Deployment": 1,
            "ClusterKopfPeering": 1,
            "PodDisruptionBudget": 1,
        },
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rendered_manifests_pass_server_dry_run(
    crds: DevCluster, namespace: str, other_namespace: str, tmp_path: Path, case: str
) -> None:
    make_values, expected_kinds = CASES[case]
    docs = render(crds, tmp_path, namespace, make_values(namespace, other_namespace))
    kinds: dict[str, int] = {}
    for doc in docs:
        kinds[doc["kind"]] = kinds.get(doc["kind"], 0) + 1
    assert kinds == expected_kinds
    cluster_scoped = {"ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering"}
    for doc in docs:  # explicit namespaces: `helm template | kubectl apply` lands right too
        assert ("namespace" in doc["metadata"]) == (doc["kind"] not in cluster_scoped), doc

    path = tmp_path / "rendered.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    out = crds.kubectl("apply", "--dry-run=server", "-f", str(path), check=False)
    assert out.returncode == 0, out.stderr
    accepted = [line for line in out.stdout.splitlines() if line.endswith("(server dry run)")]
    assert len(accepted) == len(docs), out.stdout


def test_operator_command_follows_values(crds: DevCluster, namespace: str, tmp_path: Path) -> None:
    def deployment(values: dict[str, Any]) -> dict[str, Any]:
        docs = render(crds, tmp_path, namespace, values)
        (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
        return deploy

    def command(deploy: dict[str, Any]) -> list[str]:
        (container,) = deploy["spec"]["template"]["spec"]["containers"]
        return [*container["command"], *container["args"]]

    default = deployment({})
    argv = command(default)
    assert argv[:2] == ["kvpool", "operator"]
    # Namespaced by default: the release's namespace only.
    assert {f"--namespace={namespace}", "--standalone", "--timer-interval=10"} <= set(argv)
    assert "--all-namespaces" not in argv
    assert "--liveness=http://0.0.0.0:8080/healthz" in argv
    assert default["spec"]["strategy"] == {"type": "Recreate"}
    # The operator knows its pods' labels (each pool's NetworkPolicy admits them); its
    # namespace comes from POD_NAMESPACE.
    labels = default["spec"]["template"]["metadata"]["labels"]
    (flag,) = [a for a in argv if a.startswith("--operator-pod-labels=")]
    pairs = dict(p.split("=", 1) for p in flag.split("=", 1)[1].split(","))
    assert pairs == default["spec"]["selector"]["matchLabels"] and pairs.items() <= labels.items()
    (container,) = default["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert not [a for a in argv if a.startswith("--allowed-image-prefix")]
    assert "--allow-foreign-handoff-peers" not in argv
    assert "--allow-node-sockets" not in argv

    bounded = command(
        deployment(
            {
                "operator": {
                    "clusterWide": True,
                    "allowedImagePrefixes": ["ghcr.io/kvpool/", "registry.local/"],
                    "allowForeignHandoffPeers": True,
                    "allowNodeSockets": True,
                }
            }
        )
    )
    assert "--all-namespaces" in bounded and not [a for a in bounded if "--namespace=" in a]
    assert "--allowed-image-prefix=ghcr.io/kvpool/" in bounded
    assert "--allowed-image-prefix=registry.local/" in bounded
    assert "--allow-foreign-handoff-peers" in bounded
    assert "--allow-node-sockets" in bounded
    # The flags the chart writes are the ones `kvpool operator` takes.
    from kvpool_cli import build_parser

    parsed = build_parser().parse_args(bounded[1:])
    assert parsed.allowed_image_prefix == ["ghcr.io/kvpool/", "registry.local/"]
    assert parsed.all_namespaces and parsed.allow_foreign_handoff_peers
    assert parsed.allow_node_sockets

    ha = deployment(
        {"operator": {"replicas": 2, "watchNamespaces": ["a", "b"], "peering": {"enabled": True}}}
    )
    argv = command(ha)
    assert argv[:2] == ["/bin/sh", "-c"] and "--priority=" in argv[2]
    assert argv[3:5] == ["kvpool", "operator"]
    assert {"--namespace=a", "--namespace=b", "--peering=kvpool-operator"} <= set(argv)
    assert "--standalone" not in argv and "--all-namespaces" not in argv
    assert ha["spec"]["replicas"] == 2
    assert ha["spec"]["strategy"]["type"] == "RollingUpdate"
    # The wrapper hands the arguments through untouched and adds a random priority per start.
    echoed = [
        subprocess.run([*argv[:3], "echo", "x y", "z"], capture_output=True, text=True, check=True)
        for _ in range(2)
    ]
    first, second = (e.stdout.split() for e in echoed)
    assert first[:3] == ["x", "y", "z"] and first[3].startswith("--priority=")
    assert int(first[3].split("=")[1]) != int(second[3].split("=")[1])


# -- values.schema.json through helm ------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("operator.replicas", "two"),
        ("operator.watchNamespaces", ["Not_A_Namespace"]),
        ("image.pullPolicy", "Sometimes"),
        ("serviceMonitor.interval", "30 seconds"),
        ("rbac.create", "yes"),
    ],
)
@pytest.mark.parametrize("command", ["template", "lint"])
def test_schema_errors_name_the_field(
    dev_cluster: DevCluster, tmp_path: Path, command: str, path: str, value: Any
) -> None:
    *parents, leaf = path.split(".")
    values: dict[str, Any] = {leaf: value}
    for step in reversed(parents):
        values = {step: values}
    out = dev_cluster.helm(
        command, str(CHART), "-f", str(write_values(tmp_path, values)), check=False
    )
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "schema" in text.lower(), text
    assert path in text or "/" + path.replace(".", "/") in text, text


def test_cluster_wide_with_listed_namespaces_is_refused(
    dev_cluster: DevCluster, tmp_path: Path
) -> None:
    values = write_values(tmp_path, {"operator": {"clusterWide": True, "watchNamespaces": ["a"]}})
    out = dev_cluster.helm("template", str(CHART), "-f", str(values), check=False)
    assert out.returncode != 0
    assert "operator.clusterWide=true serves every namespace" in out.stderr


def test_operator_network_policy_admits_only_the_health_port(
    crds: DevCluster, namespace: str, tmp_path: Path
) -> None:
    docs = render(crds, tmp_path, namespace, {})
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
    assert policy["spec"]["podSelector"] == deploy["spec"]["selector"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress open
    assert policy["spec"]["ingress"] == [{"ports": [{"port": "health", "protocol": "TCP"}]}]
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    assert [p["name"] for p in container["ports"]] == ["health"]
    off = render(crds, tmp_path, namespace, {"networkPolicy": {"enabled": False}})
    assert "NetworkPolicy" not in {d["kind"] for d in off}


def test_operator_metrics_port_is_opt_in_and_admits_the_listed_peers(
    crds: DevCluster, namespace: str, tmp_path: Path
) -> None:
    prometheus = {"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}
    values = {"operator": {"metrics": {"enabled": True, "port": 9102, "from": [prometheus]}}}
    docs = render(crds, tmp_path, namespace, values)
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    assert {"name": "KVPOOL_OPERATOR_METRICS_PORT", "value": "9102"} in container["env"]
    assert {"name": "metrics", "containerPort": 9102, "protocol": "TCP"} in container["ports"]
    assert policy["spec"]["ingress"] == [
        {"ports": [{"port": "health", "protocol": "TCP"}]},
        {"ports": [{"port": "metrics", "protocol": "TCP"}], "from": [prometheus]},
    ]
    # The defaults open no metrics port at all (the test above).
    env = render(crds, tmp_path, namespace, {})
    (deploy,) = [d for d in env if d["kind"] == "Deployment"]
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    assert all(e["name"] != "KVPOOL_OPERATOR_METRICS_PORT" for e in container["env"])


def test_replicas_without_peering_are_refused_with_the_reason(
    dev_cluster: DevCluster, tmp_path: Path
) -> None:
    values = write_values(tmp_path, {"operator": {"replicas": 2}})
    out = dev_cluster.helm("template", str(CHART), "-f", str(values), check=False)
    assert out.returncode != 0
    assert "operator.replicas > 1 needs operator.peering.enabled=true" in out.stderr


# -- install -------------------------------------------------------------------------------


def can_i(cluster: DevCluster, sa: str, verb: str, resource: str, namespace: str) -> bool:
    resource, _, sub = resource.partition("/")
    extra = [f"--subresource={sub}"] if sub else []
    out = cluster.kubectl(
        "auth", "can-i", verb, resource, *extra, "-n", namespace, f"--as={sa}", check=False
    )
    return out.stdout.strip() == "yes"


def test_install_creates_crds_rbac_and_deployment(
    crds: DevCluster, namespace: str, tmp_path: Path
) -> None:
    cluster = crds
    # Prove that `helm install` itself installs crds/: remove the peering CRDs first.
    cluster.kubectl("delete", "crd", *PEERING_CRDS, "--wait=true", "--timeout=60s")
    release = release_name()
    values = write_values(
        tmp_path, {"operator": {"clusterWide": True, "peering": {"enabled": True}}}
    )
    cluster.helm("install", release, str(CHART), "-n", namespace, "-f", str(values))
    try:
        wait_established(cluster, "kvcachepools.kvpool.io", *PEERING_CRDS)
        fullname = f"{release}-kvpool"
        deploy = get_json(cluster, "deployment", fullname, "-n", namespace)
        assert deploy is not None
        pod = deploy["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == fullname
        assert pod["securityContext"]["runAsNonRoot"] is True
        container = pod["containers"][0]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert "--peering=kvpool-operator" in container["args"]
        assert container["resources"]["requests"] and container["resources"]["limits"]
        for kind in ("clusterrole", "clusterrolebinding"):
            assert get_json(cluster, kind, fullname) is not None
        assert get_json(cluster, "clusterkopfpeering", "kvpool-operator") is not None

        sa = f"system:serviceaccount:{namespace}:{fullname}"
        allowed = [
            ("watch", "kvcachepools.kvpool.io"),
            ("patch", "kvcachepools.kvpool.io/status"),
            ("patch", "kvcachepools.kvpool.io/scale"),
            ("patch", "statefulsets.apps"),
            ("create", "poddisruptionbudgets.policy"),
            ("list", "pods"),
            ("create", "events"),
            ("watch", "clusterkopfpeerings.kopf.dev"),
            # Credentials of the pools, read by name; a removed tenant's Secret deleted.
            ("get", "secrets"),
            ("create", "secrets"),
            ("delete", "secrets"),
            ("patch", "networkpolicies.networking.k8s.io"),
        ]
        denied = [
            ("delete", "statefulsets.apps"),
            ("list", "secrets"),  # never every Secret of a namespace
            ("watch", "secrets"),
            ("create", "pods"),
            ("update", "kvcachepools.kvpool.io"),
            ("delete", "kvcachepools.kvpool.io"),
            ("create", "servicemonitors.monitoring.coreos.com"),  # rbac.serviceMonitors off
        ]
        for verb, resource in allowed:
            assert can_i(cluster, sa, verb, resource, "anywhere"), (verb, resource)
        for verb, resource in denied:
            assert not can_i(cluster, sa, verb, resource, "anywhere"), (verb, resource)

        # The documented upgrade path: CRDs by server-side apply, then helm upgrade.
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART_CRDS))
        upgraded = write_values(
            tmp_path,
            {"operator": {"clusterWide": True, "peering": {"enabled": True}, "timerInterval": 5}},
        )
        cluster.helm("upgrade", release, str(CHART), "-n", namespace, "-f", str(upgraded))
        deploy = get_json(cluster, "deployment", fullname, "-n", namespace)
        assert deploy is not None
        assert "--timer-interval=5" in deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    finally:
        cluster.helm("uninstall", release, "-n", namespace, check=False)
    assert get_json(cluster, "clusterrole", fullname) is None
    # Helm leaves CRDs (and so every pool) alone on uninstall, as the README says.
    assert get_json(cluster, "crd", "kvcachepools.kvpool.io") is not None


# -- the operator under the chart's RBAC ---------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def service_account_user(
    cluster: DevCluster, namespace: str, sa: str, credential: str, tmp_path: Path
) -> dict[str, str]:
    """Kubeconfig user entry that authenticates as the service account.

    ``token``: a TokenRequest token, as in a pod. ``client-cert``: a certificate from the
    cluster CA whose subject is the service account's user name and groups; RBAC sees the
    same identity, without going through bearer-token handling.
    """
    if credential == "token":
        token = cluster.kubectl("create", "token", sa, "-n", namespace, "--duration=1h")
        return {"token": token.stdout.strip()}
    cert, key = issue_client_cert(cluster.pki, service_account_identity(namespace, sa), tmp_path)
    return {"client-certificate": str(cert), "client-key": str(key)}


def service_account_kubeconfig(
    cluster: DevCluster, namespace: str, sa: str, credential: str, tmp_path: Path
) -> Path:
    """The admin kubeconfig's cluster entry with the service account as the user."""
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    cluster_entry = admin["clusters"][0]
    user = service_account_user(cluster, namespace, sa, credential, tmp_path)
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [cluster_entry],
        "users": [{"name": sa, "user": user}],
        "contexts": [{"name": sa, "context": {"cluster": cluster_entry["name"], "user": sa}}],
        "current-context": sa,
    }
    path = tmp_path / "sa.kubeconfig"
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def deployed_command(cluster: DevCluster, name: str, namespace: str) -> list[str]:
    """The operator container's command line, as the installed Deployment runs it."""
    deploy = get_json(cluster, "deployment", name, "-n", namespace)
    assert deploy is not None
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    return [*container["command"], *container["args"]]


@contextlib.contextmanager
def operator_process(
    argv: list[str], kubeconfig: Path, log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """The chart's operator command line as a local child process (the kvpool console
    script is on PATH here as in the image); only the liveness address changes, to a free
    loopback port."""
    port = free_port()
    liveness = f"--liveness=http://127.0.0.1:{port}/healthz"
    argv = [liveness if a.startswith("--liveness=") else a for a in argv]
    assert liveness in argv, argv
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}/healthz"

            def healthy() -> bool:
                assert proc.poll() is None, log.read_text()
                try:
                    with urllib.request.urlopen(url, timeout=1) as resp:
                        return bool(resp.status == 200)
                except OSError:
                    return False

            wait_until("the operator's liveness endpoint", healthy, timeout=60)
            yield proc
        finally:
            stop(proc)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def unrefused(log: Path, check: Callable[[], bool]) -> Callable[[], bool]:
    """``check``, failing at once (not at a timeout) when the API server refused the operator."""

    def checked() -> bool:
        assert "forbidden" not in log.read_text().lower(), "the operator was refused a request"
        return check()

    return checked


@contextlib.contextmanager
def log_on_failure(log: Path) -> Iterator[None]:
    """A failed wait says what the operator logged."""
    try:
        yield
    except AssertionError as err:
        raise AssertionError(
            f"{err}\n--- operator log (tail) ---\n{log.read_text()[-6000:]}"
        ) from err


POOL: dict[str, Any] = {
    "apiVersion": "kvpool.io/v1alpha1",
    "kind": "KVCachePool",
    "metadata": {"name": "rbac-pool"},
    "spec": {
        "replicas": 1,
        "model": {"name": "tiny", "numLayers": 4, "numKvHeads": 2, "headDim": 64},
        "kvCacheConfig": {"tokensPerBlock": 16},
        "pod": {"resources": {"limits": {"nvidia.com/gpu": 1}}},
    },
}


@pytest.mark.parametrize("credential", ["token", "client-cert"])
def test_operator_reconciles_with_only_the_charts_namespaced_rbac(
    crds: DevCluster, namespace: str, tmp_path: Path, credential: str
) -> None:
    """The default RBAC: a Role in the release's namespace, nothing cluster-wide but kopf's
    read-only scanning."""
    cluster = crds
    release = release_name()
    values = write_values(
        tmp_path, {"operator": {"timerInterval": 2}, "rbac": {"serviceMonitors": True}}
    )
    cluster.helm("install", release, str(CHART), "-n", namespace, "-f", str(values))
    fullname = f"{release}-kvpool"
    log = tmp_path / "operator.log"
    try:
        kubeconfig = service_account_kubeconfig(cluster, namespace, fullname, credential, tmp_path)
        # The service account sees nothing outside its namespace.
        out = cluster.kubectl(
            "--kubeconfig", str(kubeconfig), "get", "kvcachepools", "-A", check=False
        )
        assert out.returncode != 0 and "forbidden" in out.stderr.lower()

        argv = deployed_command(cluster, fullname, namespace)
        assert argv[:2] == ["kvpool", "operator"] and f"--namespace={namespace}" in argv
        with operator_process(argv, kubeconfig, log), log_on_failure(log):
            # Every child kind, ServiceMonitor included (its stand-in CRD is installed).
            pool = json.loads(json.dumps(POOL))
            pool["spec"]["monitoring"] = {"serviceMonitor": True}
            pool_file = tmp_path / "pool.yaml"
            pool_file.write_text(yaml.safe_dump(pool))
            cluster.kubectl("apply", "-n", namespace, "-f", str(pool_file))
            name = POOL["metadata"]["name"]
            children = [
                ("secret", f"{name}-tenant-default"),
                ("secret", f"{name}-auth"),
                ("configmap", f"{name}-agent-config"),
                ("service", name),
                ("networkpolicy", name),
                ("statefulset", name),
                ("poddisruptionbudget", name),
                ("servicemonitor", name),
            ]
            for kind, child in children:
                found = unrefused(log, exists(cluster, kind, child, namespace))
                wait_until(f"{kind}/{child}", found)

            def status_written() -> bool:
                pool = get_json(cluster, "kvcachepool", name, "-n", namespace) or {}
                status = pool.get("status") or {}
                return bool(status.get("conditions")) and status.get("observedGeneration") == 1

            wait_until("the pool's status", unrefused(log, status_written))
            # A deleted tenant Secret comes back (a new token) under the same Role.
            tenant = f"{name}-tenant-default"
            before = get_json(cluster, "secret", tenant, "-n", namespace)
            cluster.kubectl("delete", "secret", tenant, "-n", namespace)

            def reissued() -> bool:
                now = get_json(cluster, "secret", tenant, "-n", namespace)
                return now is not None and now["data"] != (before or {}).get("data")

            wait_until("the tenant Secret reissued", unrefused(log, reissued))
            # A timer pass lists the agent pods (metrics) and writes status again.
            timer_ran = unrefused(log, lambda: "Timer 'on_timer' succeeded" in log.read_text())
            wait_until("a timer pass", timer_ran)
            events = cluster.kubectl(
                "get", "events", "-n", namespace, "--field-selector",
                f"involvedObject.name={name}", "-o", "json",
            )  # fmt: skip
            reasons = {e["reason"] for e in json.loads(events.stdout)["items"]}
            assert "Created" in reasons, reasons
        text = log.read_text()
        assert "forbidden" not in text.lower() and " 403" not in text, text[-4000:]
    finally:
        cluster.kubectl(
            "delete", "kvcachepool", "--all", "-n", namespace, "--wait=false", check=False
        )
        cluster.helm("uninstall", release, "-n", namespace, check=False)


def peering_state(log: Path) -> str | None:
    """ "Resuming" or "Pausing": what kopf's peering last logged, None before either."""
    text = log.read_text()
    found = {word: text.rfind(f"{word} operations") for word in ("Resuming", "Pausing")}
    latest = max(found, key=lambda w: found[w])
    return latest if found[latest] >= 0 else None


def peers(cluster: DevCluster, peering: str) -> dict[str, Any]:
    obj = get_json(cluster, "clusterkopfpeering", peering) or {}
    return {k: v for k, v in (obj.get("status") or {}).items() if v}


def test_two_replicas_one_works_the_other_takes_over(
    crds: DevCluster, namespace: str, tmp_path: Path
) -> None:
    """replicas: 2 with peering, both run as the Deployment runs them: one reconciles, the
    other stays paused until the first stops, then takes over."""
    cluster = crds
    release = release_name()
    peering = f"kvpool-{release}"
    values = {
        "operator": {
            "replicas": 2,
            "clusterWide": True,  # one ClusterKopfPeering for the two replicas
            "peering": {"enabled": True, "name": peering},
            "timerInterval": 2,
        },
        "podDisruptionBudget": {"enabled": True},
    }
    cluster.helm(
        "install", release, str(CHART), "-n", namespace, "-f", str(write_values(tmp_path, values))
    )
    fullname = f"{release}-kvpool"
    logs = [tmp_path / "operator-0.log", tmp_path / "operator-1.log"]
    try:
        kubeconfig = service_account_kubeconfig(cluster, namespace, fullname, "token", tmp_path)
        argv = deployed_command(cluster, fullname, namespace)
        with contextlib.ExitStack() as stack:
            procs = [stack.enter_context(operator_process(argv, kubeconfig, log)) for log in logs]
            stack.enter_context(log_on_failure(logs[0]))
            stack.enter_context(log_on_failure(logs[1]))
            wait_until(
                "both peers in the peering object", lambda: len(peers(cluster, peering)) == 2
            )
            priorities = sorted(p["priority"] for p in peers(cluster, peering).values())
            assert priorities[0] != priorities[1]

            def working() -> list[int]:
                """Peers start paused (peering is mandatory) and log when they resume or
                pause again; the working one's last word is "Resuming"."""
                return [i for i, log in enumerate(logs) if peering_state(log) == "Resuming"]

            wait_until("one operator to work", lambda: len(working()) == 1)
            time.sleep(3)  # both peers have seen each other's keep-alive by now

            pool_file = tmp_path / "pool.yaml"
            pool_file.write_text(yaml.safe_dump(POOL))
            cluster.kubectl("apply", "-n", namespace, "-f", str(pool_file))
            name = POOL["metadata"]["name"]
            wait_until(
                "an operator's StatefulSet",
                unrefused(
                    logs[0], unrefused(logs[1], exists(cluster, "statefulset", name, namespace))
                ),
            )

            # Under load the first peer to resume may pause again once it sees a higher
            # priority: which one works is decided by peering, so find it by what it did. Its
            # "Created" event comes after all the children, so the StatefulSet may be there
            # before the line is in its log.
            def creators() -> list[int]:
                return [i for i, log in enumerate(logs) if "Created" in log.read_text()]

            wait_until("an operator to log what it created", lambda: bool(creators()))
            found = creators()
            assert len(found) == 1, f"exactly one replica reconciles, got {found}"
            (active,) = found
            standby = 1 - active
            assert working() == [active]

            # Failover: stop the active operator; the standby resumes and reconciles a change.
            stop(procs[active])
            wait_until("the standby to resume", lambda: peering_state(logs[standby]) == "Resuming")
            cluster.kubectl(
                "patch", "kvcachepool", name, "-n", namespace, "--type=merge",
                "-p", json.dumps({"spec": {"replicas": 2}}),
            )  # fmt: skip

            def scaled() -> bool:
                sts = get_json(cluster, "statefulset", name, "-n", namespace) or {}
                return (sts.get("spec") or {}).get("replicas") == 2

            wait_until("the standby to scale the StatefulSet", unrefused(logs[standby], scaled))
        for log in logs:
            assert "forbidden" not in log.read_text().lower()
    finally:
        cluster.kubectl(
            "delete", "kvcachepool", "--all", "-n", namespace, "--wait=false", check=False
        )
        cluster.helm("uninstall", release, "-n", namespace, check=False)
