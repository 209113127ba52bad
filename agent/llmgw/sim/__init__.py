"""Simulators for running llmgw where there is no GPU.

``llmgw.sim.engine`` is the engine simulator (``llmgw-engine-sim``): vLLM's
command line and OpenAI-compatible HTTP API, with deterministic output and
injectable faults, used by tests, demos and router benchmarks.
"""
