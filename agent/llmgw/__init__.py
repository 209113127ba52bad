"""llmgw: control plane, router and node agent for LLM inference fleets."""

__version__ = "0.1.0"
