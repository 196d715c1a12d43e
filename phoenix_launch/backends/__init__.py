"""Backends that start one agent per node."""
