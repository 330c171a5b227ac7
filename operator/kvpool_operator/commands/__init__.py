"""The operator's ``kvpool`` subcommands, one module each; ``kvpool_cli`` offers them."""

COMMANDS: dict[str, str] = {
    "crd": "kvpool_operator.commands.crd",
    "operator": "kvpool_operator.commands.operator",
}
"""Subcommand name -> module implementing it."""

EXTRA = "operator"
"""The extra of ``kvpool`` these commands need to run (kopf, the kubernetes client)."""
