"""Recovery: the pure plan, the recovery session, the salvage, persistent checkpoints."""
