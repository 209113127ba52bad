"""llmgw: control plane, router and node agent for LLM inference fleets."""

from importlib import metadata as _metadata

# The installed distribution's version, so what an agent reports (and drift
# compares) is the build it really runs, not a constant a release can forget.
try:
    __version__ = _metadata.version("llmgw")
except _metadata.PackageNotFoundError:  # a source tree on sys.path, never installed
    __version__ = "0+unknown"
