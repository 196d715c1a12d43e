"""Detect: the agents (rank exits, hangs), node heartbeats and lifecycles, health probes."""
