"""A thin Kubernetes REST layer: server-side apply, reads, status and scale patches, events.

It speaks plain JSON over the official client's connection handling (kubeconfig or in-cluster
credentials, TLS), so children are applied as the dicts ``kvpool_operator.children`` builds,
with no typed-model round trip that could drop fields.
"""

from __future__ import annotations

import datetime
import json
import os
import uuid
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import kopf
from kubernetes import client, config

from kvpool_operator.models import FIELD_MANAGER, GROUP, PLURAL, VERSION

Manifest = dict[str, Any]

PLURALS: dict[str, str] = {
    "ConfigMap": "configmaps",
    "Secret": "secrets",
    "NetworkPolicy": "networkpolicies",
    "Service": "services",
    "Pod": "pods",
    "Event": "events",
    "StatefulSet": "statefulsets",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "ServiceMonitor": "servicemonitors",
    "KVCachePool": PLURAL,
}

REQUEST_TIMEOUT = 10.0


class KubeError(RuntimeError):
    """A failed API call: HTTP status, Kubernetes reason, and the server's message."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message

    @property
    def not_found(self) -> bool:
        return self.status == 404


def object_path(api_version: str, kind: str, namespace: str | None, name: str | None = None) -> str:
    """The REST path of a namespaced object (or of its collection when ``name`` is None)."""
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    path = f"{base}/namespaces/{quote(namespace)}" if namespace else base
    path = f"{path}/{PLURALS[kind]}"
    return f"{path}/{quote(name)}" if name else path


def pool_path(namespace: str, name: str, subresource: str = "") -> str:
    path = f"/apis/{GROUP}/{VERSION}/namespaces/{quote(namespace)}/{PLURAL}/{quote(name)}"
    return f"{path}/{subresource}" if subresource else path


@dataclass
class KubeApi:
    """JSON requests against one API server with the official client's credentials."""

    api_client: client.ApiClient
    field_manager: str = FIELD_MANAGER

    @classmethod
    def from_environment(cls) -> KubeApi:
        """In-cluster credentials when running in a pod, else the current kubeconfig."""
        conf = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=conf)
        except config.ConfigException:
            # Read $KUBECONFIG now, not at import time as the client's default does.
            config.load_kube_config(
                config_file=os.environ.get("KUBECONFIG"), client_configuration=conf
            )
        return cls(client.ApiClient(conf))

    @classmethod
    def for_host(cls, host: str) -> KubeApi:
        """An unauthenticated client for a given URL (tests against a mock server)."""
        conf = client.Configuration(host=host)
        return cls(client.ApiClient(conf))

    def connection_info(self) -> kopf.ConnectionInfo:
        """The same credentials for kopf's own watch connections (one source of truth)."""
        conf = self.api_client.configuration
        # The kubernetes client stores kubeconfig and in-cluster tokens as "BearerToken"
        # ("authorization" in older releases); either way the value is "<scheme> <token>".
        auth = conf.get_api_key_with_prefix("BearerToken", alias="authorization") or ""
        scheme, _, token = auth.partition(" ")
        return kopf.ConnectionInfo(
            server=conf.host,
            ca_path=conf.ssl_ca_cert,
            insecure=not conf.verify_ssl,
            username=conf.username or None,
            password=conf.password or None,
            scheme=scheme or None,
            token=token or None,
            certificate_path=conf.cert_file,
            private_key_path=conf.key_file,
        )

    def request(
        self,
        method: str,
        path: str,
        *,
        query: dict[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> Manifest:
        m, url, headers, payload, _ = self.api_client.param_serialize(
            method=method,
            resource_path=path,
            query_params=list((query or {}).items()),
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            body=body,
            auth_settings=["BearerToken"],
        )
        try:
            resp = self.api_client.call_api(
                m, url, header_params=headers, body=payload, _request_timeout=REQUEST_TIMEOUT
            )
            data = resp.read()
            status = resp.status
        except client.ApiException as err:
            data, status = (err.body or b""), int(err.status or 0)
        text = data.decode() if isinstance(data, bytes) else str(data or "")
        try:
            parsed = json.loads(text) if text else {}
        except json.JSONDecodeError:
            parsed = {"message": text}
        if status >= 400 or status == 0:
            raise KubeError(
                status, str(parsed.get("reason", "Error")), str(parsed.get("message", text))
            )
        return parsed if isinstance(parsed, dict) else {"items": parsed}

    def apply(self, manifest: Manifest) -> Manifest:
        """Server-side apply under our field manager, taking over conflicting fields."""
        meta = manifest["metadata"]
        path = object_path(
            manifest["apiVersion"], manifest["kind"], meta.get("namespace"), meta["name"]
        )
        return self.request(
            "PATCH",
            path,
            query={"fieldManager": self.field_manager, "force": "true"},
            body=manifest,
            content_type="application/apply-patch+yaml",
        )

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Manifest | None:
        try:
            return self.request("GET", object_path(api_version, kind, namespace, name))
        except KubeError as err:
            if err.not_found:
                return None
            raise

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """Delete an object; False when it was already gone."""
        try:
            self.request("DELETE", object_path(api_version, kind, namespace, name))
        except KubeError as err:
            if err.not_found:
                return False
            raise
        return True

    def list(
        self, api_version: str, kind: str, namespace: str, label_selector: str
    ) -> list[Manifest]:
        data = self.request(
            "GET",
            object_path(api_version, kind, namespace),
            query={"labelSelector": label_selector},
        )
        return list(data.get("items") or [])

    def patch_pool_status(self, namespace: str, name: str, status: dict[str, Any]) -> Manifest:
        """Merge-patch ``status`` through the status subresource."""
        return self.request(
            "PATCH",
            pool_path(namespace, name, "status"),
            body={"status": status},
            content_type="application/merge-patch+json",
        )

    def scale_pool(self, namespace: str, name: str, replicas: int) -> Manifest:
        """Set ``spec.replicas`` through the scale subresource (as ``kubectl scale`` does)."""
        return self.request(
            "PATCH",
            pool_path(namespace, name, "scale"),
            body={"spec": {"replicas": replicas}},
            content_type="application/merge-patch+json",
        )

    def api_group_served(self, group_version: str) -> bool:
        """Whether the API server serves a group/version (e.g. a CRD is installed)."""
        try:
            self.request("GET", f"/apis/{group_version}")
        except KubeError as err:
            if err.not_found:
                return False
            raise
        return True

    def post_event(
        self,
        involved: Manifest,
        event_type: str,
        reason: str,
        message: str,
        component: str = FIELD_MANAGER,
    ) -> Manifest:
        """A core/v1 Event about an object (``kubectl describe`` shows it)."""
        meta = involved["metadata"]
        now = datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        namespace = meta.get("namespace") or "default"
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "name": f"{meta['name']}.{uuid.uuid4().hex[:12]}",
                "namespace": namespace,
            },
            "involvedObject": {
                "apiVersion": involved.get("apiVersion"),
                "kind": involved.get("kind"),
                "name": meta["name"],
                "namespace": namespace,
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "type": event_type,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": component},
            "reportingComponent": component,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        return self.request("POST", object_path("v1", "Event", namespace), body=event)
