"""The ``kvpool`` command: the components' registered subcommands, each once, and a clear
error naming the extra to install when a command's third-party imports are missing."""

from __future__ import annotations

import argparse

import pytest

import kvpool_agent.commands
import kvpool_operator.commands
from kvpool_cli import OWN_COMMANDS, build_parser, commands, main


def test_every_registered_command_is_offered_once() -> None:
    names = [c.name for c in commands()]
    expected = [
        *OWN_COMMANDS,
        *kvpool_agent.commands.COMMANDS,
        *kvpool_operator.commands.COMMANDS,
    ]
    assert names == expected and len(set(names)) == len(names)
    assert {"size", "agent", "drive", "operator", "crd"} <= set(names)
    assert "dev-cluster" not in names  # dev tooling is `kvpool-dev`, not shipped
    extras = {c.name: c.extra for c in commands()}
    assert extras["agent"] == "agent" and extras["operator"] == "operator"


def _failing_run(error: BaseException) -> object:
    def run(args: argparse.Namespace) -> int:
        raise error

    return run


def test_a_missing_extra_is_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvpool_operator.commands import operator

    monkeypatch.setattr(
        operator, "run", _failing_run(ModuleNotFoundError("No module named 'kopf'", name="kopf"))
    )
    assert main(["operator", "--standalone"]) == 2
    err = capsys.readouterr().err
    assert "kvpool operator: needs the 'operator' extra" in err
    assert "pip install 'kvpool[operator]'" in err and "'kopf'" in err


def test_a_missing_kvpool_module_is_not_blamed_on_an_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvpool_operator.commands import crd

    broken = ModuleNotFoundError("No module named 'kvpool_operator.x'", name="kvpool_operator.x")
    monkeypatch.setattr(crd, "run", _failing_run(broken))
    with pytest.raises(ModuleNotFoundError):
        main(["crd"])


def test_parser_builds_without_running_anything() -> None:
    args = build_parser().parse_args(["size", "crds/examples/cpu-dev.yaml"])
    assert args.command == "size" and args._extra == "agent"
