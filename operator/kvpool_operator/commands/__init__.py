"""``kvpool`` subcommands implemented by the operator package."""
