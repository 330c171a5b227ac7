"""The Dockerfiles, checked without a container engine (there is none here).

What can be checked statically is what usually goes wrong: a floating base tag, running as
root, the wrong extra, a CMD the CLI does not accept, a uid or port that disagrees with the
pods the operator and the chart build, and a .dockerignore that drops a copied path.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpool_cli import build_parser
from kvpool_operator import children
from kvpool_operator.models import DEFAULT_IMAGE, KVCachePool

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "images"
PINNED_BASE = re.compile(r"^python:3\.11\.\d+-slim-bookworm$")


@dataclass
class Dockerfile:
    """The instructions of a Dockerfile that matter here, continuation lines joined."""

    args: dict[str, str] = field(default_factory=dict)
    froms: list[str] = field(default_factory=list)
    copies: list[list[str]] = field(default_factory=list)
    runs: list[str] = field(default_factory=list)
    users: list[str] = field(default_factory=list)
    exposes: list[int] = field(default_factory=list)
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, path: Path) -> Dockerfile:
        text = re.sub(r"\\\n", " ", path.read_text())
        out = cls()
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            word, _, rest = line.partition(" ")
            word, rest = word.upper(), rest.strip()
            if word == "ARG" and "=" in rest:
                name, _, default = rest.partition("=")
                out.args.setdefault(name, default.strip('"'))
            elif word == "FROM":
                image = rest.split()[0]
                out.froms.append(re.sub(r"\$\{(\w+)\}", lambda m: out.args[m[1]], image))
            elif word == "COPY":
                out.copies.append(shlex.split(rest))
            elif word == "RUN":
                out.runs.append(rest)
            elif word == "USER":
                out.users.append(rest)
            elif word == "EXPOSE":
                out.exposes.extend(int(p) for p in rest.split())
            elif word == "ENTRYPOINT":
                out.entrypoint = yaml.safe_load(rest)
            elif word == "CMD":
                out.cmd = yaml.safe_load(rest)
        return out


def agent_pod_template() -> dict[str, Any]:
    """The pod template the operator builds for the example CPU pool."""
    doc = yaml.safe_load((REPO / "crds" / "examples" / "cpu-dev.yaml").read_text())
    doc["metadata"].setdefault("namespace", "default")
    doc["metadata"].setdefault("uid", "00000000-0000-0000-0000-000000000000")
    return children.desired_pod_template(KVCachePool.model_validate(doc))


@pytest.fixture(scope="module", params=["operator", "agent"])
def image(request: pytest.FixtureRequest) -> tuple[str, Dockerfile]:
    name = str(request.param)
    return name, Dockerfile.parse(IMAGES / f"{name}.Dockerfile")


def test_base_image_is_an_exact_tag(image: tuple[str, Dockerfile]) -> None:
    _, df = image
    assert df.froms and all(PINNED_BASE.match(f) or f == "build" for f in df.froms), df.froms
    assert PINNED_BASE.match(df.froms[-1])


def test_runs_as_numeric_non_root_user(image: tuple[str, Dockerfile]) -> None:
    _, df = image
    assert df.users, "no USER"
    uid, _, gid = df.users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0 and (not gid or int(gid) != 0)
    # The operator's agent pods and the chart's Deployment both run as this uid.
    assert int(uid) == children.AGENT_UID
    chart_values = yaml.safe_load((REPO / "charts" / "kvpool" / "values.yaml").read_text())
    assert chart_values["podSecurityContext"]["runAsUser"] == int(uid)


def test_installs_the_right_extra(image: tuple[str, Dockerfile]) -> None:
    name, df = image
    install = next(r for r in df.runs if "pip install" in r)
    if name == "operator":
        assert "[operator]" in install and "agent" not in install
    else:
        assert df.args["KVPOOL_EXTRAS"] == "agent" and "[${KVPOOL_EXTRAS}]" in install


def test_command_is_accepted_by_the_cli(image: tuple[str, Dockerfile]) -> None:
    name, df = image
    assert df.entrypoint == ["kvpool"]
    args = build_parser().parse_args(df.cmd)
    assert args.command == name
    if name == "agent":
        # The pod template the operator builds runs exactly this.
        (container,) = agent_pod_template()["spec"]["containers"]
        assert [*df.entrypoint, *df.cmd] == [*container["command"], *container["args"]]
        assert df.exposes == [children.AGENT_PORT]
    else:
        assert args.standalone and args.all_namespaces
        assert df.exposes == [8080] and "0.0.0.0:8080/healthz" in args.liveness


def test_copied_paths_exist_and_are_not_ignored(image: tuple[str, Dockerfile]) -> None:
    _, df = image
    ignored = [
        line.strip().rstrip("/")
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for copy in df.copies:
        if any(a.startswith("--from") for a in copy):
            continue
        for src in copy[:-1]:
            top = src.rstrip("/").split("/")[0]
            assert (REPO / src).exists(), src
            assert top not in ignored, f"{src} is excluded by .dockerignore"


def test_nothing_is_written_outside_tmp(image: tuple[str, Dockerfile]) -> None:
    """The root filesystem is read-only at run time: HOME and caches point at /tmp."""
    _, df = image
    text = (IMAGES / f"{image[0]}.Dockerfile").read_text()
    assert "HOME=/tmp" in text and "PYTHONDONTWRITEBYTECODE=1" in text
    assert df.runs and all("rm -rf /wheels" in r for r in df.runs if "pip install" in r)


def test_image_names_agree_with_operator_and_chart() -> None:
    """The agent image the CRD defaults to and the operator image the chart runs are the
    ones the Dockerfiles say to build."""
    agent_text = (IMAGES / "agent.Dockerfile").read_text()
    assert f"-t {DEFAULT_IMAGE} ." in agent_text
    chart = yaml.safe_load((REPO / "charts" / "kvpool" / "Chart.yaml").read_text())
    values = yaml.safe_load((REPO / "charts" / "kvpool" / "values.yaml").read_text())
    operator_image = f"{values['image']['repository']}:{chart['appVersion']}"
    assert f"-t {operator_image} ." in (IMAGES / "operator.Dockerfile").read_text()
    assert DEFAULT_IMAGE.endswith(f":{chart['appVersion']}")
