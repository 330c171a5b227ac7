"""The agent's ``kvpool`` subcommands, one module each; ``kvpool_cli`` offers them."""

COMMANDS: dict[str, str] = {
    "replay": "kvpool_agent.commands.replay",
    "drive": "kvpool_agent.commands.drive",
    "plan": "kvpool_agent.commands.plan",
    "trace": "kvpool_agent.commands.trace",
    "agent": "kvpool_agent.commands.agent",
}
"""Subcommand name -> module implementing it."""

EXTRA = "agent"
"""The extra of ``kvpool`` these commands need to run (torch, the HTTP stack)."""
