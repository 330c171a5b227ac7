"""Fast checks of the dev tooling (``kvpool_dev``) that need no cluster: certificates,
kubeconfigs, node manifests, build bookkeeping, pod filtering, process cleanup, the
``kvpool-dev`` command and the loopback kubelet's command lines."""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from kubernetes import client

from kvpool_dev import certs
from kvpool_dev.build import (
    ALL_BINARIES,
    BuildLayout,
    Versions,
    ensure_built,
    k8s_ldflags,
    parse_staging_modules,
    prune_go_caches,
)
from kvpool_dev.cluster import (
    GPU_RESOURCE,
    KWOK_ANNOTATION,
    ClusterConfig,
    ClusterError,
    ClusterState,
    GpuNodeSpec,
    free_ports,
    process_alive,
    stop_processes,
)
from kvpool_dev.kubelet import PeerProxies, project_agent_config
from kvpool_dev.podagents import PodInfo, command_template, pod_info


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> certs.PkiPaths:
    paths = certs.PkiPaths(tmp_path_factory.mktemp("pki"))
    certs.generate_pki(paths, "10.96.0.1")
    return paths


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_apiserver_cert_is_signed_by_ca_and_names_loopback_and_service(
    pki: certs.PkiPaths,
) -> None:
    ca, cert = _cert(pki.ca_cert), _cert(pki.apiserver_cert)
    cert.verify_directly_issued_by(ca)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    ips = {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
    assert ips == {"127.0.0.1", "10.96.0.1"}
    assert {"localhost", "kubernetes.default.svc"} <= set(sans.get_values_for_type(x509.DNSName))
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in eku


@pytest.mark.parametrize(
    ("who", "groups"),
    [
        (certs.ADMIN, ["system:masters"]),
        (certs.SCHEDULER, []),
        (certs.CONTROLLER_MANAGER, []),
    ],
)
def test_client_certs_carry_user_and_groups(
    pki: certs.PkiPaths, who: certs.ClientIdentity, groups: list[str]
) -> None:
    cert = _cert(pki.client_cert(who))
    cert.verify_directly_issued_by(_cert(pki.ca_cert))
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    orgs = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)]
    assert cn == who.user
    assert orgs == groups
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert stat.S_IMODE(pki.client_key(who).stat().st_mode) == 0o600


def test_kubeconfig_loads_in_the_python_client(pki: certs.PkiPaths, tmp_path: Path) -> None:
    from kubernetes import config

    path = tmp_path / "admin.kubeconfig"
    certs.write_kubeconfig(path, "https://127.0.0.1:6443", pki, certs.ADMIN, "dev")
    doc = yaml.safe_load(path.read_text())
    assert doc["current-context"] == "dev"
    assert Path(doc["users"][0]["user"]["client-key"]).is_absolute()
    configuration = client.Configuration()
    config.load_kube_config(config_file=str(path), client_configuration=configuration)
    assert configuration.host == "https://127.0.0.1:6443"
    assert configuration.ssl_ca_cert == str(pki.ca_cert)


def test_gpu_node_manifest_has_gpu_capacity_and_kwok_annotation() -> None:
    node = GpuNodeSpec("n0", gpus=4, labels={"pool": "a"}).manifest()
    assert node["metadata"]["annotations"] == {KWOK_ANNOTATION: "fake"}
    assert node["status"]["capacity"][GPU_RESOURCE] == "4"
    assert node["status"]["allocatable"] == node["status"]["capacity"]
    assert node["metadata"]["labels"]["pool"] == "a"
    assert node["metadata"]["labels"]["kubernetes.io/hostname"] == "n0"


def test_pod_cidr_is_loopback_and_validated(tmp_path: Path) -> None:
    cidr = ipaddress.ip_network(ClusterConfig(state_dir=tmp_path).resolved_pod_cidr())
    assert cidr.prefixlen == 16 and cidr.network_address.is_loopback
    assert ClusterConfig(tmp_path, pod_cidr="127.9.0.0/16").resolved_pod_cidr() == "127.9.0.0/16"
    for bad in ("10.0.0.0/16", "127.9.0.0/24", "nonsense"):
        with pytest.raises(ClusterError, match="pod_cidr"):
            ClusterConfig(tmp_path, pod_cidr=bad).resolved_pod_cidr()


def test_free_ports_are_distinct_and_bindable() -> None:
    import socket

    ports = free_ports(8)
    assert len(set(ports)) == 8
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_each_node_gets_its_own_pod_cidr() -> None:
    state = ClusterState(
        name="t",
        state_dir="/nonexistent",
        bin_dir="/nonexistent",
        server="",
        kubeconfig="",
        pod_cidr="127.9.0.0/22",
        ports={},
        pids={},
        started_at=0.0,
    )
    cidrs = []
    for i in range(3):
        cidr = state.next_node_cidr()
        state.node_cidrs[f"n{i}"] = cidr
        cidrs.append(cidr)
    assert cidrs == ["127.9.1.0/24", "127.9.2.0/24", "127.9.3.0/24"]
    with pytest.raises(ClusterError, match="no free /24"):
        state.next_node_cidr()
    node = GpuNodeSpec("n0").manifest(cidrs[0])
    assert node["spec"] == {"podCIDR": "127.9.1.0/24", "podCIDRs": ["127.9.1.0/24"]}


def test_staging_modules_are_parsed_from_go_mod() -> None:
    go_mod = (
        "module k8s.io/kubernetes\n\nrequire (\n\tk8s.io/api v0.0.0\n)\n\nreplace (\n"
        "\tk8s.io/api => ./staging/src/k8s.io/api\n"
        "\tk8s.io/client-go => ./staging/src/k8s.io/client-go\n"
        "\tgithub.com/x/y => github.com/x/y v1.0.0\n)\n"
    )
    assert parse_staging_modules(go_mod) == ["k8s.io/api", "k8s.io/client-go"]


def test_versions_and_ldflags() -> None:
    versions = Versions(kubernetes="v1.36.4")
    assert versions.staging == "v0.36.4"
    flags = k8s_ldflags(versions)
    assert "-X k8s.io/component-base/version.gitVersion=v1.36.4" in flags
    assert "-X k8s.io/component-base/version.gitMinor=36" in flags
    assert flags.startswith("-s -w")


def test_ensure_built_is_a_noop_once_stamped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = BuildLayout(root=tmp_path)
    assert not layout.is_built()
    layout.bin_dir.mkdir(parents=True)
    for name in ALL_BINARIES:
        layout.binary(name).write_text("#!/bin/sh\n")
        layout.binary(name).chmod(0o755)
    assert not layout.is_built()  # no stamp yet: a half-finished build is not "built"
    layout.stamp.write_text(json.dumps({"versions": {}}))
    assert layout.is_built()
    monkeypatch.setenv("PATH", "")  # would fail if it tried to run go
    assert ensure_built(root=tmp_path).bin_dir == layout.bin_dir


def test_prune_go_caches_removes_read_only_module_cache_but_keeps_binaries(
    tmp_path: Path,
) -> None:
    layout = BuildLayout(root=tmp_path)
    module = layout.go_dir / "mod" / "example.com" / "m@v1.0.0"
    module.mkdir(parents=True)
    (module / "go.mod").write_text("module example.com/m\n")
    module.chmod(0o555)  # Go writes its module cache read-only
    layout.bin_dir.mkdir(parents=True)
    layout.binary("etcd").write_text("bin")
    prune_go_caches(layout)
    assert not layout.go_dir.exists()
    assert layout.binary("etcd").read_text() == "bin"


def _v1pod(
    phase: str = "Running", ip: str | None = "127.20.0.5", deleting: bool = False
) -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(
            name="p",
            namespace="ns",
            uid="u-1",
            labels={"role": "agent"},
            deletion_timestamp=dt.datetime(2026, 1, 1, tzinfo=dt.UTC) if deleting else None,
        ),
        spec=client.V1PodSpec(
            containers=[
                client.V1Container(
                    name="agent",
                    ports=[
                        client.V1ContainerPort(container_port=8080),
                        client.V1ContainerPort(container_port=9090),
                    ],
                )
            ],
            node_name="gpu-node-0",
        ),
        status=client.V1PodStatus(phase=phase, pod_ip=ip),
    )


def test_pod_info_only_for_running_loopback_pods() -> None:
    info = pod_info(_v1pod())
    assert info is not None
    assert (info.key, info.pod_ip, info.node_name) == ("ns/p", "127.20.0.5", "gpu-node-0")
    assert info.ports == (8080, 9090)
    assert pod_info(_v1pod(phase="Pending")) is None
    assert pod_info(_v1pod(ip=None)) is None
    assert pod_info(_v1pod(ip="10.0.0.5")) is None
    assert pod_info(_v1pod(deleting=True)) is None


def test_command_template_formats_fields_and_honours_selector() -> None:
    pod = PodInfo(
        "ns", "p", "u-1", "127.20.0.5", "gpu-node-0", labels={"role": "agent"}, ports=(8080,)
    )
    factory = command_template(
        ["agent", "--host", "{pod_ip}", "--port", "{port}", "--name={namespace}/{name}"]
    )
    assert factory(pod) == ["agent", "--host", "127.20.0.5", "--port", "8080", "--name=ns/p"]
    only_cache = command_template(["x"], selector=lambda p: p.labels.get("role") == "cache")
    assert only_cache(pod) is None


def _wait_exec(state: ClusterState, name: str) -> None:
    """Popen returns before the child has exec'd the binary; wait until it has."""
    deadline = time.monotonic() + 5
    while not process_alive(state, name):
        assert time.monotonic() < deadline, f"{name} never started"
        time.sleep(0.01)


def test_stop_processes_kills_group_and_skips_reused_pids(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sleep = shutil.which("sleep")
    assert sleep is not None
    shutil.copy(sleep, bin_dir / "etcd")
    proc = subprocess.Popen([str(bin_dir / "etcd"), "60"], start_new_session=True)
    state = ClusterState(
        name="t",
        state_dir=str(tmp_path),
        bin_dir=str(bin_dir),
        server="https://127.0.0.1:1",
        kubeconfig="",
        pod_cidr="127.9.0.0/16",
        ports={},
        # This test process is not bin/kube-apiserver: it must be left alone.
        pids={"etcd": proc.pid, "kube-apiserver": os.getpid()},
        started_at=time.time(),
    )
    _wait_exec(state, "etcd")
    assert not process_alive(state, "kube-apiserver")
    assert stop_processes(state, grace_s=5) == ["etcd"]
    assert proc.wait(timeout=5) is not None
    assert not process_alive(state, "etcd")


def _cli(argv: list[str]) -> int:
    from kvpool_dev.cli import main

    return main(["cluster", *argv])


def test_cli_env_status_down_work_from_state_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sleep = shutil.which("sleep")
    assert sleep is not None
    shutil.copy(sleep, bin_dir / "kwok")
    proc = subprocess.Popen([str(bin_dir / "kwok"), "60"], start_new_session=True)
    ClusterState(
        name="t",
        state_dir=str(tmp_path),
        bin_dir=str(bin_dir),
        server="https://127.0.0.1:1",
        kubeconfig=str(tmp_path / "admin.kubeconfig"),
        pod_cidr="127.9.0.0/16",
        ports={},
        pids={"kwok": proc.pid},
        started_at=time.time(),
    ).save()

    _wait_exec(ClusterState.load(tmp_path), "kwok")
    assert _cli(["env", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"export KUBECONFIG={tmp_path / 'admin.kubeconfig'}" in out
    assert f"export PATH={bin_dir}:" in out

    assert _cli(["status", "--dir", str(tmp_path)]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["components"] == {"kwok": {"pid": proc.pid, "running": True}}

    assert _cli(["down", "--dir", str(tmp_path)]) == 0
    assert proc.wait(timeout=5) is not None
    assert _cli(["status", "--dir", str(tmp_path)]) == 3  # nothing runs any more
    assert _cli(["env", "--dir", str(tmp_path / "missing")]) == 1


def test_container_argv_rewrites_pod_paths_but_never_the_interpreter(tmp_path: Path) -> None:
    """A clone under /tmp while /tmp is a pod volume: the interpreter (and so the project)
    stays where it is; only the container's own pod paths move to the pod's directory."""
    import sys

    from kvpool_dev.kubelet import container_argv

    rewrites = {"/tmp": str(tmp_path / "pod" / "tmp"), "/etc/kvpool": str(tmp_path / "cfg")}
    # the interpreter's own directory is a pod mount path too (as /tmp is, for a clone there)
    rewrites[str(Path(sys.executable).parent)] = str(tmp_path / "pod" / "venv")
    argv = container_argv(["kvpool", "agent", "--config", "/etc/kvpool/agent.yaml"], rewrites)
    assert argv[0] == sys.executable
    assert argv[1:] == ["-m", "kvpool_cli", "agent", "--config", f"{tmp_path}/cfg/agent.yaml"]
    assert container_argv(["/tmp/x", "/tmpfoo"], rewrites) == [f"{tmp_path}/pod/tmp/x", "/tmpfoo"]


def test_harness_reports_agents_that_cannot_start_or_exit(tmp_path: Path) -> None:
    """An agent whose command cannot run, or that exits, is reported with the reason, the
    exit code and its log's tail (never retried in silence)."""
    from kvpool_dev.podagents import PodAgentHarness

    commands = {
        "missing": [str(tmp_path / "no-such-python"), "-m", "x"],
        "crashing": ["sh", "-c", "echo 'kvpool agent: invalid config'; exit 3"],
    }
    harness = PodAgentHarness(
        tmp_path / "kubeconfig", lambda pod: commands[pod.name], log_dir=tmp_path / "logs"
    )
    harness.log_dir.mkdir()
    for name in commands:
        pod = _v1pod()
        pod.metadata.name, pod.metadata.uid = name, f"uid-{name}"
        harness._reconcile_pod(pod, deleted=False)
    deadline = time.monotonic() + 10
    while all(p.running() for p in harness.processes().values()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    problems = harness.problems()
    assert len(problems) == 2
    missing = next(p for p in problems if "pod ns/missing" in p)
    assert "cannot start" in missing and "no-such-python" in missing
    crashed = next(p for p in problems if "pod ns/crashing" in p)
    assert "exited with code 3" in crashed and "invalid config" in crashed
    harness.stop()


def test_projected_agent_config_names_peers_by_proxy_and_tells_each_agent_its_own() -> None:
    """The loopback cluster has no DNS for the pods' stable names: peers become the proxies'
    URLs, the agents' ring, and each pod's config names its own entry as ``self_url``."""
    proxies = PeerProxies()
    try:
        peers = [f"http://kvp-{i}.kvp.ns.svc:8000" for i in range(2)]
        doc = {
            "auth": {"tenants_file": "/etc/kvpool/auth/tenants.yaml"},
            "lifecycle": {"handoff_peers": peers},
        }
        text = yaml.safe_dump(doc)
        one = yaml.safe_load(
            project_agent_config(text, {"/etc/kvpool/auth": "/tmp/pod/auth"}, "kvp-1", proxies)
        )
        ring = [proxies.url_for("ns", f"kvp-{i}", 8000) for i in range(2)]
        assert one["lifecycle"] == {"handoff_peers": ring, "self_url": ring[1]}
        assert one["auth"]["tenants_file"] == "/tmp/pod/auth/tenants.yaml"
        zero = yaml.safe_load(project_agent_config(text, {}, "kvp-0", proxies))
        assert zero["lifecycle"]["self_url"] == ring[0]
        # A pod not among the peers (another pool's) is told nothing about itself.
        other = yaml.safe_load(project_agent_config(text, {}, "kvp-10", proxies))
        assert "self_url" not in other["lifecycle"]
        assert project_agent_config("not: [yaml", {}, "kvp-0", proxies) == "not: [yaml"
    finally:
        proxies.close()
