"""Observe: status.json, events.jsonl, metrics, the live view, refused values."""
