"""kvpool node agent: the paged KV cache engine, its sizing, tiers, API and metrics."""

__version__ = "0.1.0"
