"""``phoenix-run report``: one self-contained HTML page of what happened in a run.

* :mod:`.timeline`: ``events.jsonl`` -> :class:`Timeline` (progress, incidents, node states, spares, memory);
  pure, tolerant of missing fields;
* :mod:`.cost`: the work lost against checkpoint-restart, with the simulator's closed forms;
* :mod:`.charts`: the charts (matplotlib, an optional extra) as base64 PNG;
* :mod:`.page`: the HTML page;
* :mod:`.command`: the command, and :func:`write_report`, which ties the above together.
"""

from __future__ import annotations

from .command import write_report
from .cost import CostComparison, compare
from .timeline import Incident, ReportInputError, Timeline, build_timeline, read_timeline

__all__ = ["write_report", "compare", "CostComparison", "Incident", "ReportInputError", "Timeline",
           "build_timeline", "read_timeline"]
