"""Helpers for the runtime's background threads (a leaf: imported by the snapshot and replication engines)."""

from __future__ import annotations

import os
import threading


def background_priority(nice: int = 10) -> None:
    """Lower the calling thread's CPU priority (Linux: per-thread nice), so that the protection pipeline
    fills the training thread's idle time instead of competing with its compute."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (OSError, AttributeError):
        pass
