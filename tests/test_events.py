"""The events' schema (``observe/event_types.py``): every event the launcher writes is a type of it with its fields,
and what is written reads back typed; files of older or newer writers stay readable."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

import phoenix_launch
from phoenix_launch.observe import event_types as E
from phoenix_launch.observe.events import EventLog, read_events

pytestmark = pytest.mark.timeout(60)
ROOT = Path(phoenix_launch.__file__).parent


def test_every_event_written_is_in_the_schema():
    """Each ``emit("type", field=...)`` in the launcher names a type of the schema and only its fields."""
    sites, bad = 0, []
    for f in sorted(ROOT.rglob("*.py")):
        for n in ast.walk(ast.parse(f.read_text())):
            if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "emit" and n.args):
                continue
            if not (isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str)):
                continue
            sites += 1
            cls = E.TYPES.get(n.args[0].value)
            names = {k.arg for k in n.keywords if k.arg}
            if cls is None or not names <= set(cls.__dataclass_fields__):
                bad.append(f"{f.relative_to(ROOT)}:{n.lineno} {n.args[0].value} {sorted(names)}")
    assert sites > 50 and bad == []


def test_an_event_outside_the_schema_is_refused_and_one_inside_reads_back_typed(tmp_path):
    log = EventLog(tmp_path / "events.jsonl")
    with pytest.raises(ValueError, match="no field"):
        log.emit("hotswap", gen=1, failed="n1", whatever=2)
    with pytest.raises(ValueError, match="no event type"):
        log.emit("hot_swap", gen=1)
    log.emit("hotswap", gen=1, failed="n1", spare="s0", joiners=[2, 3], spares_left=0)
    log.emit(E.Decision(cls="host", action="replace_node", decision="hotswap", node="n1", spare="s0", reason="lost"))
    log.close()
    with open(tmp_path / "events.jsonl") as f:
        (swap, decision), skipped = read_events(f)
    assert skipped == 0 and isinstance(swap.event, E.Hotswap) and swap.event.joiners == [2, 3] and swap.t > 0
    assert isinstance(decision.event, E.Decision) and decision.event.reason == "lost" and decision.v == E.SCHEMA


def test_older_and_newer_lines_stay_readable():
    lines = [
        json.dumps({"v": 1, "t": 1.0, "type": "recovery", "path": "hotswap", "recovered_s": 0.5}),  # fields missing
        json.dumps({"v": 9, "t": 2.0, "type": "recovery", "path": "local", "new_field": 3}),  # a field unknown here
        json.dumps({"t": 3.0, "type": "a_new_type", "x": 1}),
        "{torn",
        "[1]",
    ]
    (old, new, other), skipped = read_events(lines)
    assert skipped == 2 and old.event.total_s is None and old.event.recovered_s == 0.5
    assert new.extra == {"new_field": 3} and new.row()["new_field"] == 3 and new.type == "recovery"
    assert (
        isinstance(other.event, E.Unknown)
        and other.type == "a_new_type"
        and other.row() == {"v": 0, "t": 3.0, "type": "a_new_type", "x": 1}
    )
