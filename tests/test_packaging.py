"""What ships and which way the dependencies point.

The ``kvpool`` wheel (and so the images) holds the agent, the kernels, the operator and the
CLI above them; the dev tooling (``devtools/kvpool_dev``: the local control plane, the pod
harness, the e2e stack) is a distribution of its own that nothing shipped imports. Within
the wheel: ``kvpool_cli -> kvpool_operator -> kvpool_agent.config``, ``kvpool_agent ->
kvpool_kernels``, never upwards, not even by a module name in a string.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
FIND = PYPROJECT["tool"]["setuptools"]["packages"]["find"]
SHIPPED = {"kvpool_agent": "agent", "kvpool_kernels": "kernels", "kvpool_operator": "operator"}
SHIPPED["kvpool_cli"] = "cli"
PACKAGE_NAME = re.compile(r"\b(kvpool_(?:agent|kernels|operator|cli|dev))\b")
MAY_NOT_IMPORT = {
    "kvpool_kernels": {"kvpool_agent", "kvpool_operator", "kvpool_cli", "kvpool_dev"},
    "kvpool_agent": {"kvpool_operator", "kvpool_cli", "kvpool_dev"},
    "kvpool_operator": {"kvpool_cli", "kvpool_dev"},
    "kvpool_cli": {"kvpool_dev"},
}


def test_the_wheel_is_the_four_packages() -> None:
    assert sorted(FIND["where"]) == sorted(SHIPPED.values())
    assert sorted(p.rstrip("*") for p in FIND["include"]) == sorted(SHIPPED)
    assert PYPROJECT["project"]["scripts"] == {"kvpool": "kvpool_cli:main"}


def _imported(path: Path) -> set[str]:
    """Top-level kvpool_* packages a module imports or names in a string (``"pkg.module"``,
    as a dispatch table would); docstrings are prose and do not count."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
        ):
            found.update(PACKAGE_NAME.findall(node.value))
    return found


@pytest.mark.parametrize("package", sorted(MAY_NOT_IMPORT))
def test_dependencies_point_down(package: str) -> None:
    folder = REPO / SHIPPED[package] / package
    wrong = {
        f"{path.relative_to(REPO)} -> {name}"
        for path in folder.rglob("*.py")
        for name in _imported(path) & MAY_NOT_IMPORT[package]
    }
    assert not wrong, sorted(wrong)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None, reason="needs setuptools")
def test_built_wheel_holds_no_dev_tooling(tmp_path: Path) -> None:
    """``pip wheel .`` from what the Dockerfiles copy (in a copy, so no build/ directory is
    left in the checkout): the four packages and nothing else."""
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for folder in SHIPPED.values():
        shutil.copytree(REPO / folder, src / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation"]
        + ["--wheel-dir", str(tmp_path / "dist"), str(src)],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("kvpool-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == set(SHIPPED), tops
    assert not [n for n in names if "devcluster" in n or "kvpool_dev" in n]
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "kvpool = kvpool_cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
