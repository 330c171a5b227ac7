"""The connector's parts that need no vLLM: settings, discovery, the KV layouts, the docs."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from kvpool_agent.connectors.settings import (
    ConnectorConfigError,
    ConnectorSettings,
    Discovery,
    RequestParams,
)
from kvpool_agent.connectors.vllm.layout import BlockLayout, LayoutError, gather, scatter
from kvpool_operator import children
from kvpool_operator.models import KVCachePool

DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"


def test_settings_refuse_bad_fields_by_name() -> None:
    with pytest.raises(ConnectorConfigError, match="set exactly one of `pool`"):
        ConnectorSettings.parse({})
    with pytest.raises(ConnectorConfigError, match="set exactly one"):
        ConnectorSettings.parse({"pool": "p", "replicas": ["h:1"]})
    with pytest.raises(ConnectorConfigError, match="`unix_socket` beside either"):
        ConnectorSettings.parse({"pool": "p", "replicas": ["h:1"], "unix_socket": "/r/t.sock"})
    both = ConnectorSettings.parse({"replicas": ["h:1"], "unix_socket": "/run/kvpool/t.sock"})
    assert both.replicas == ["h:1"] and both.unix_socket == "/run/kvpool/t.sock"
    with pytest.raises(ConnectorConfigError, match="unix_socket: String should have at most"):
        ConnectorSettings.parse({"unix_socket": "/" + "x" * 120})
    assert ConnectorSettings.parse({"unix_socket": "/run/t.sock"}).unix_socket == "/run/t.sock"
    with pytest.raises(ConnectorConfigError, match=r"lookup_timeout_s: .*greater than 0"):
        ConnectorSettings.parse({"pool": "p", "lookup_timeout_s": 0})
    with pytest.raises(ConnectorConfigError, match="poool: Extra inputs"):
        ConnectorSettings.parse({"poool": "p"})
    with pytest.raises(ConnectorConfigError, match="not HOST:PORT"):
        ConnectorSettings.parse({"replicas": ["no-port"]})
    with pytest.raises(ConnectorConfigError, match="pool: String should match"):
        ConnectorSettings.parse({"pool": "Not_A_Name"})
    with pytest.raises(ConnectorConfigError, match=r"load_layer_chunks: .*greater than or equal"):
        ConnectorSettings.parse({"pool": "p", "load_layer_chunks": 0})
    with pytest.raises(ConnectorConfigError, match="layerwise: Input should be a valid boolean"):
        ConnectorSettings.parse({"pool": "p", "layerwise": "sometimes"})


def test_a_requests_params_narrow_the_pool_and_name_what_is_wrong() -> None:
    # Without a kvpool entry (no params, another connector's only): the engine's settings.
    for params in (None, {}, {"do_remote_prefill": True}):
        assert RequestParams.of(params) == RequestParams(load=True, save=True)
    assert RequestParams.of({"kvpool": {"save": False}}) == RequestParams(load=True, save=False)
    assert RequestParams.of({"kvpool": {"load": False, "save": False}}) == RequestParams(
        load=False, save=False
    )
    assert RequestParams.of({"kvpool": {}}) == RequestParams()
    with pytest.raises(ValueError, match=r"kv_transfer_params\.kvpool\.sav: Extra inputs"):
        RequestParams.of({"kvpool": {"sav": False}})
    # Strict: "false" or 0 is not a boolean (an opt-out must say what it means).
    with pytest.raises(ValueError, match=r"kv_transfer_params\.kvpool\.save: .*boolean"):
        RequestParams.of({"kvpool": {"save": "false"}})
    with pytest.raises(ValueError, match=r"kv_transfer_params\.kvpool\.load: .*boolean"):
        RequestParams.of({"kvpool": {"load": 0}})
    with pytest.raises(ValueError, match=r"kv_transfer_params\.kvpool: .*dictionary"):
        RequestParams.of({"kvpool": ["save"]})
    with pytest.raises(ValueError, match="kv_transfer_params: a JSON object"):
        RequestParams.of(["kvpool"])


def test_load_streams_default_to_a_quarter_of_the_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = ConnectorSettings.parse({"pool": "p"})
    for cpus, streams in ((1, 1), (2, 1), (8, 2), (16, 4), (64, 4)):
        monkeypatch.setattr("os.sched_getaffinity", lambda _pid, n=cpus: set(range(n)))
        assert settings.streams() == streams, cpus
    assert ConnectorSettings.parse({"pool": "p", "load_streams": 8}).streams() == 8
    for bad in (0, 17):
        with pytest.raises(ConnectorConfigError, match="load_streams"):
            ConnectorSettings.parse({"pool": "p", "load_streams": bad})


def test_token_comes_from_the_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVPOOL_TOKEN", "from-env")
    assert ConnectorSettings.parse({"pool": "p"}).token() == "from-env"
    token = tmp_path / "token"
    token.write_text("from-file\n")
    assert ConnectorSettings.parse({"pool": "p", "token_file": str(token)}).token() == "from-file"
    token.write_text("two words\n")
    with pytest.raises(ConnectorConfigError, match="token_file: expected one token"):
        ConnectorSettings.parse({"pool": "p", "token_file": str(token)}).token()
    with pytest.raises(ConnectorConfigError, match="token_file: cannot read"):
        ConnectorSettings.parse({"pool": "p", "token_file": str(tmp_path / "none")}).token()


def test_discovery_finds_the_pods_stable_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ordinals resolve until DISCOVERY_MISSES in a row do not (a pod not ready leaves a gap)."""
    live = {"pool-0.pool.ns.svc", "pool-1.pool.ns.svc", "pool-3.pool.ns.svc"}
    asked: list[str] = []

    def resolve(host: str, port: int, **_: Any) -> list[Any]:
        asked.append(host)
        if host not in live:
            raise socket.gaierror("NXDOMAIN")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.1", port))]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    found = Discovery(ConnectorSettings.parse({"pool": "pool", "namespace": "ns"})).replicas()
    assert found == [f"pool-{i}.pool.ns.svc:8100" for i in (0, 1, 3)]
    assert asked[-1] == "pool-7.pool.ns.svc"  # 4 misses after ordinal 3, then it stops
    explicit = Discovery(ConnectorSettings.parse({"replicas": ["127.0.0.1:9"]}))
    assert explicit.replicas() == ["127.0.0.1:9"]


def test_cpu_layout_reads_k_rows_then_v_rows() -> None:
    layout = BlockLayout.for_backend("CPU_ATTN", block_size=32, kv_heads=2, head_dim=32)
    pages = torch.randn(10, 2, 32, 64)  # vLLM's logical [blocks, heads, bs, 2 * dim]
    view = layout.blocks_view(pages)
    rows = pages.view(10, 2, 64, 32)  # what the CPU kernel reads: 2 * bs rows per head
    assert torch.equal(view[:, 0], rows[:, :, :32].permute(0, 2, 1, 3))  # K
    assert torch.equal(view[:, 1], rows[:, :, 32:].permute(0, 2, 1, 3))  # V


def test_gpu_layout_reads_k_and_v_halves() -> None:
    layout = BlockLayout.for_backend("FLASH_ATTN", block_size=16, kv_heads=8, head_dim=128)
    pages = torch.randn(5, 8, 16, 256)
    view = layout.blocks_view(pages)
    assert torch.equal(view[3, 0, 4, 2], pages[3, 2, 4, :128])
    assert torch.equal(view[3, 1, 4, 2], pages[3, 2, 4, 128:])


def test_gather_and_scatter_move_whole_blocks_of_every_layer() -> None:
    layout = BlockLayout.for_backend("CPU_ATTN", block_size=32, kv_heads=2, head_dim=32)
    layers = [torch.randn(8, 2, 32, 64) for _ in range(3)]
    views = [layout.blocks_view(t) for t in layers]
    kv = gather(views, [5, 2])
    assert kv.shape == (3, 2, 2, 32, 2, 32)
    before = [t.clone() for t in layers]
    scatter(views, [0, 7], kv)
    for layer, old in zip(layers, before, strict=True):
        assert torch.equal(layer[0], old[5]) and torch.equal(layer[7], old[2])
        assert torch.equal(layer[1:7], old[1:7])  # nothing else was touched
    with pytest.raises(LayoutError, match="expected 3 layers of 1 blocks"):
        scatter(views, [1], kv)


def test_unknown_backends_and_shapes_are_start_up_errors() -> None:
    with pytest.raises(LayoutError, match="'FLASHMLA' is not supported"):
        BlockLayout.for_backend("FLASHMLA", 16, 1, 576)
    layout = BlockLayout.for_backend("CPU_ATTN", 32, 2, 32)
    with pytest.raises(LayoutError, match=r"expected \[blocks, 2, 32, 64\]"):
        layout.blocks_view(torch.zeros(4, 2, 16, 64))


def test_the_docs_examples_are_valid() -> None:
    text = DOC.read_text()
    for name in ConnectorSettings.model_fields:  # every setting has its row
        assert f"\n| `{name}`" in text or f", `{name}` |" in text, name
    config = json.loads(re.search(r"```json\n(.*?)```", text, re.S).group(1))  # type: ignore[union-attr]
    assert config["kv_connector_module_path"] == "kvpool_agent.connectors.vllm"
    assert config["kv_load_failure_policy"] == "recompute"
    ConnectorSettings.parse(config["kv_connector_extra_config"])
    # The per-request example parses, and each of its keys has a row.
    requests = [
        json.loads(block)
        for block in re.findall(r"```json\n(.*?)```", text, re.S)
        if "kv_transfer_params" in block
    ]
    assert requests and all(RequestParams.of(r["kv_transfer_params"]) for r in requests)
    for name in RequestParams.model_fields:
        assert f"\n| `{name}` |" in text, name
    manifests = list(yaml.safe_load_all(re.search(r"```yaml\n(.*?)```", text, re.S).group(1)))  # type: ignore[union-attr]
    pool = KVCachePool.model_validate(manifests[0])
    deployment = manifests[1]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    flag = next(a for a in container["args"] if a.startswith("--kv-transfer-config="))
    transfer = json.loads(flag.split("=", 1)[1])
    extra = ConnectorSettings.parse(transfer["kv_connector_extra_config"])
    assert extra.pool == pool.name
    block = next(a for a in container["args"] if a.startswith("--block-size="))
    assert int(block.split("=")[1]) == pool.spec.kv_cache_config.tokens_per_block
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels["kvpool.io/client"] == pool.name
    secret = deployment["spec"]["template"]["spec"]["volumes"][0]["secret"]["secretName"]
    assert secret == f"{pool.name}-tenant-{pool.spec.auth.tenants[0].name}"


def test_the_node_socket_example_matches_the_operators_pods() -> None:
    """The second example (a pool with nodeSocket and an engine on its nodes): the engine
    mounts the directory the operator gives the pool's agents, the connector's socket is
    the one the agents serve, and the engine runs in the agents' group."""
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    pool_doc, deployment = yaml.safe_load_all(blocks[1])
    pool = KVCachePool.model_validate(pool_doc)
    assert pool.spec.pod.node_socket
    template = deployment["spec"]["template"]["spec"]
    (container,) = template["containers"]
    flag = next(a for a in container["args"] if a.startswith("--kv-transfer-config="))
    extra = ConnectorSettings.parse(json.loads(flag.split("=", 1)[1])["kv_connector_extra_config"])
    assert extra.pool == pool.name
    volume = next(v for v in template["volumes"] if "hostPath" in v)
    assert volume["hostPath"]["path"] == children.node_socket_dir(pool)
    mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
    # The same file of the node as the agents' socket (their mount of the same directory).
    assert extra.unix_socket == f"{mount['mountPath']}/{Path(children.NODE_SOCKET_PATH).name}"
    assert children.AGENT_UID in template["securityContext"]["supplementalGroups"]
    assert children.pod_agent_config(pool).transfer.unix_socket_mode & 0o060 == 0o060
