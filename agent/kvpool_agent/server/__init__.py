"""The node agent's service around the cache: HTTP API, metrics, KV events, reload, drain.

``AgentService`` owns the engine; ``create_app`` is the ASGI app; ``kvpool agent`` runs both
under uvicorn (see ``kvpool_agent.commands.agent``). Importing this package imports torch.
"""

from kvpool_agent.server.app import create_app
from kvpool_agent.server.service import AgentService, RequestError

__all__ = ["AgentService", "RequestError", "create_app"]
