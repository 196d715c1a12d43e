"""Classify and decide: signals -> verdict -> the one decision (pure)."""
