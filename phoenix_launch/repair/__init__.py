"""Repair: generations, the recovery's watch, replenishing spares, re-protection, checkpoints."""
