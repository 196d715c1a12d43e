"""The standby supervisor, the leader's mirror, the keeper (no single point of failure)."""
