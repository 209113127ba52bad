"""``llmgw-fleet-sim``: many simulated agents on the real protocol (see docs/fleet-sim.md)."""
