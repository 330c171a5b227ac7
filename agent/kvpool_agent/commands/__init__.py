"""One module per ``kvpool`` subcommand."""
