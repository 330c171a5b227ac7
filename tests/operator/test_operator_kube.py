"""kopf's watch connections use the same credentials as the operator's own client."""

from __future__ import annotations

import pytest
from kubernetes import client

from kvpool_operator.kube import KubeApi


@pytest.mark.parametrize("key", ["BearerToken", "authorization"])
def test_connection_info_carries_the_bearer_token(key: str) -> None:
    conf = client.Configuration()
    conf.host = "https://127.0.0.1:6443"
    conf.api_key[key] = "Bearer s3cr3t-token"
    info = KubeApi(client.ApiClient(conf)).connection_info()
    assert info.server == "https://127.0.0.1:6443"
    assert (info.scheme, info.token) == ("Bearer", "s3cr3t-token")


def test_connection_info_without_token_uses_client_certificates() -> None:
    conf = client.Configuration()
    conf.host = "https://127.0.0.1:6443"
    conf.cert_file, conf.key_file = "/pki/admin.crt", "/pki/admin.key"
    info = KubeApi(client.ApiClient(conf)).connection_info()
    assert info.token is None and info.scheme is None
    assert (info.certificate_path, info.private_key_path) == ("/pki/admin.crt", "/pki/admin.key")
