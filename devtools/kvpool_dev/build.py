"""Build the dev-cluster binaries from the Go module proxy and cache them outside the repo.

Why a build and not a download: the only reachable artifact source is the Go module proxy, so
etcd, the Kubernetes control plane, kubectl, kwok and helm are compiled with the local Go
toolchain. ``k8s.io/kubernetes`` cannot be ``go install``-ed (its go.mod replaces the staging
modules with local paths), so a throwaway module requires it and points every staging module
at its published ``v0.x`` twin. The result lives in
``${KVPOOL_CACHE:-~/.cache/kvpool}/devcluster/<k8s-version>/bin`` with a stamp file per
binary, which makes a second build a no-op.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Versions:
    """Pinned versions of everything the dev cluster runs."""

    kubernetes: str = "v1.36.4"
    etcd: str = "v3.6.8"
    kwok: str = "v0.8.0"
    helm: str = "v3.22.0"

    @property
    def staging(self) -> str:
        """The published version of the staging modules (k8s.io/api etc.) for ``kubernetes``."""
        return "v0" + self.kubernetes[2:]


DEFAULT_VERSIONS = Versions()

K8S_BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
ALL_BINARIES = (*K8S_BINARIES, "etcd", "kwok", "helm")


class BuildError(RuntimeError):
    """A tool could not be built; the message names the step and carries Go's output tail."""


def cache_root() -> Path:
    """``$KVPOOL_CACHE`` or ``~/.cache/kvpool``: the parent of everything we cache."""
    env = os.environ.get("KVPOOL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvpool"


@dataclass(frozen=True)
class BuildLayout:
    """Where binaries, stamps and the Go caches live for one set of versions."""

    versions: Versions = DEFAULT_VERSIONS
    root: Path = field(default_factory=cache_root)

    @property
    def base(self) -> Path:
        return self.root / "devcluster"

    @property
    def version_dir(self) -> Path:
        return self.base / self.versions.kubernetes

    @property
    def bin_dir(self) -> Path:
        return self.version_dir / "bin"

    @property
    def stamp(self) -> Path:
        return self.version_dir / "stamp.json"

    @property
    def go_dir(self) -> Path:
        """GOPATH, GOMODCACHE and GOCACHE, shared by all versions so bumps rebuild less."""
        return self.base / "go"

    def binary(self, name: str) -> Path:
        return self.bin_dir / name

    def tool_stamp(self, tool: str) -> Path:
        return self.version_dir / f".{tool}.built"

    def is_built(self) -> bool:
        if not self.stamp.is_file():
            return False
        return all(os.access(self.binary(n), os.X_OK) for n in ALL_BINARIES)


def _go_env(layout: BuildLayout) -> dict[str, str]:
    go = layout.go_dir
    env = dict(os.environ)
    env.update(
        GOPATH=str(go / "path"),
        GOMODCACHE=str(go / "mod"),
        GOCACHE=str(go / "build"),
        GOTOOLCHAIN="local",
        CGO_ENABLED="0",
        GOFLAGS="-mod=mod -buildvcs=false",
        GOPROXY=os.environ.get("GOPROXY", "https://proxy.golang.org,direct"),
    )
    env.pop("GOBIN", None)
    return env


Log = Callable[[str], None]


def _stderr_log(msg: str) -> None:
    print(f"[dev-cluster build] {msg}", file=sys.stderr, flush=True)


def _run(cmd: list[str], cwd: Path, env: dict[str, str], step: str, log: Log) -> None:
    """Run one Go command niced (the machine is shared), raising BuildError with its output."""
    full = ["nice", "-n", "10", *cmd] if shutil.which("nice") else cmd
    log(f"{step}: {' '.join(cmd)}")
    proc = subprocess.run(full, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-4000:]
        raise BuildError(f"{step} failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")


def _write_module(workdir: Path, go_mod: str) -> None:
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    (workdir / "go.mod").write_text(go_mod)


def _go_version() -> str:
    out = subprocess.run(["go", "env", "GOVERSION"], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def _staging_modules(layout: BuildLayout, env: dict[str, str], log: Log) -> list[str]:
    """The ``k8s.io/*`` modules that k8s.io/kubernetes replaces with ``./staging`` paths."""
    mod = f"k8s.io/kubernetes@{layout.versions.kubernetes}"
    log(f"reading the go.mod of {mod}")
    proc = subprocess.run(
        ["go", "mod", "download", "-json", mod],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        cwd=layout.base,
    )
    info = json.loads(proc.stdout or "{}")
    if proc.returncode != 0 or "GoMod" not in info:
        raise BuildError(f"go mod download {mod} failed: {info.get('Error', proc.stderr)}")
    return parse_staging_modules(Path(info["GoMod"]).read_text())


def parse_staging_modules(go_mod: str) -> list[str]:
    """Module paths replaced by ``./staging/...`` in k8s.io/kubernetes's go.mod, sorted."""
    return sorted(set(re.findall(r"^\s*(k8s\.io/\S+)\s+=>\s+\./staging/", go_mod, re.M)))


def k8s_ldflags(versions: Versions) -> str:
    major, minor = versions.kubernetes[1:].split(".")[:2]
    pkg = "k8s.io/component-base/version"
    pairs = {
        "gitVersion": versions.kubernetes,
        "gitMajor": major,
        "gitMinor": minor,
        "gitTreeState": "clean",
        "buildDate": "1970-01-01T00:00:00Z",
    }
    xs = " ".join(f"-X {pkg}.{k}={v}" for k, v in pairs.items())
    # kubectl vendors its own copy of the version variables through client-go.
    xs += " " + " ".join(f"-X k8s.io/client-go/pkg/version.{k}={v}" for k, v in pairs.items())
    return f"-s -w {xs}"


def _build_kubernetes(layout: BuildLayout, env: dict[str, str], log: Log) -> None:
    v = layout.versions
    staging = _staging_modules(layout, env, log)
    replaces = "\n".join(f"\t{m} => {m} {v.staging}" for m in staging)
    work = layout.version_dir / "work" / "kubernetes"
    _write_module(
        work,
        "module kvpool.local/devcluster/kubernetes\n\ngo 1.26\n\n"
        f"require k8s.io/kubernetes {v.kubernetes}\n\nreplace (\n{replaces}\n)\n",
    )
    pkgs = [f"k8s.io/kubernetes/cmd/{b}" for b in K8S_BINARIES]
    _run(["go", "get", *(f"{p}@{v.kubernetes}" for p in pkgs)], work, env, "resolve k8s", log)
    out = layout.bin_dir
    cmd = ["go", "build", "-p", "2", "-trimpath", f"-ldflags={k8s_ldflags(v)}", "-o", f"{out}/"]
    _run([*cmd, *pkgs], work, env, "build kubernetes", log)


def _build_etcd(layout: BuildLayout, env: dict[str, str], log: Log) -> None:
    # etcd's server module also replaces its siblings with paths; same throwaway trick.
    v = layout.versions.etcd
    work = layout.version_dir / "work" / "etcd"
    _write_module(work, "module kvpool.local/devcluster/etcd\n\ngo 1.26\n")
    pkg = "go.etcd.io/etcd/server/v3"
    _run(["go", "get", f"{pkg}@{v}"], work, env, "resolve etcd", log)
    cmd = ["go", "build", "-p", "2", "-trimpath", "-ldflags=-s -w"]
    _run([*cmd, "-o", str(layout.binary("etcd")), pkg], work, env, "build etcd", log)


def _install(pkg: str, name: str, layout: BuildLayout, env: dict[str, str], log: Log) -> None:
    # kwok and helm have no path replaces, so `go install pkg@version` builds them as released.
    gobin = layout.version_dir / "work" / f"gobin-{name}"
    gobin.mkdir(parents=True, exist_ok=True)
    env = dict(env, GOBIN=str(gobin), GOFLAGS="-buildvcs=false")
    cmd = ["go", "install", "-p", "2", "-trimpath", "-ldflags=-s -w", pkg]
    _run(cmd, layout.base, env, f"build {name}", log)
    built = gobin / Path(pkg.split("@")[0]).name
    shutil.move(str(built), layout.binary(name))


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Serialize builds across processes (a pytest session and a CLI may race)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_built(
    versions: Versions = DEFAULT_VERSIONS,
    root: Path | None = None,
    log: Log = _stderr_log,
) -> BuildLayout:
    """Build whatever is missing and return the layout; a no-op once everything is cached."""
    layout = BuildLayout(versions, root or cache_root())
    if layout.is_built():
        return layout
    if shutil.which("go") is None:
        raise BuildError("the Go toolchain (`go`) is not on PATH; it is needed to build once")
    with _locked(layout.base / f".{versions.kubernetes}.lock"):
        if layout.is_built():
            return layout
        layout.bin_dir.mkdir(parents=True, exist_ok=True)
        env = _go_env(layout)
        steps: dict[str, Callable[[], None]] = {
            "kubernetes": lambda: _build_kubernetes(layout, env, log),
            "etcd": lambda: _build_etcd(layout, env, log),
            "kwok": lambda: _install(
                f"sigs.k8s.io/kwok/cmd/kwok@{versions.kwok}", "kwok", layout, env, log
            ),
            "helm": lambda: _install(
                f"helm.sh/helm/v3/cmd/helm@{versions.helm}", "helm", layout, env, log
            ),
        }
        timings: dict[str, float] = {}
        for tool, step in steps.items():
            if layout.tool_stamp(tool).is_file():
                continue
            start = time.monotonic()
            step()
            timings[tool] = round(time.monotonic() - start, 1)
            layout.tool_stamp(tool).write_text(str(timings[tool]))
            log(f"{tool} built in {timings[tool]:.0f}s")
        shutil.rmtree(layout.version_dir / "work", ignore_errors=True)
        stamp = {
            "versions": versions.__dict__,
            "go": _go_version(),
            "build_seconds": {
                t: float(layout.tool_stamp(t).read_text()) for t in steps if t in timings
            },
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        layout.stamp.write_text(json.dumps(stamp, indent=2) + "\n")
    return layout


def prune_go_caches(layout: BuildLayout) -> None:
    """Drop the Go module and build caches (the binaries stay); module files are read-only."""
    go = layout.go_dir
    for path in go.rglob("*"):
        if path.is_dir() and not path.is_symlink():
            path.chmod(0o755)
    shutil.rmtree(go, ignore_errors=True)
