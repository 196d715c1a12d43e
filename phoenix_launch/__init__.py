"""PHOENIX launcher: CLI, supervisor, control plane, backends."""
