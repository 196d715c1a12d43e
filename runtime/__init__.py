"""PHOENIX runtime, injected into every rank."""
