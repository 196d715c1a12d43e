"""Failure injection: ``phoenix-run kill-node`` (the client) and its execution in the supervisor.

Modes: ``crash`` (the whole node: agent and ranks SIGKILLed), ``rank`` (one rank SIGKILLed), ``hang``
(SIGSTOP), ``comm`` (a transient communication failure of the node's ranks: their process groups are
aborted while the processes stay healthy), ``gpu-ecc`` / ``pcie`` (an error of that class raised inside
the rank at its next step boundary, to exercise classification). With ``--at-step N`` the fault is armed in
the ranks and fires when they reach step N (needs the PHOENIX runtime in the script).
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

from phoenix_runtime import protocol as P

MODES = ("crash", "rank", "hang", "comm", "gpu-ecc", "pcie")


class InjectError(RuntimeError):
    pass


def resolve_target(sup, target: str) -> tuple[str, int | None]:
    """TARGET is a node name or ``rank:R``; returns (node, slot or None for the whole node)."""
    if target.startswith("rank:"):
        try:
            r = int(target.split(":", 1)[1])
        except ValueError:
            raise InjectError(f"bad target {target!r}: use rank:R with an integer R") from None
        if not 0 <= r < sup.world_size:
            raise InjectError(f"no rank {r} in this job (world size {sup.world_size})")
        rs = sup.members.slot_of(r)
        return rs.node, rs.slot
    if target not in sup.nodes:
        raise InjectError(f"no node {target!r} in this job; nodes: {', '.join(sup.nodes)}")
    if sup.nodes[target].state.value in ("failed", "drained", "stopped"):
        raise InjectError(f"node {target} is {sup.nodes[target].state.value}; nothing to inject")
    return target, None


def execute_injection(sup, c: dict[str, Any]) -> tuple[bool, str, dict[str, Any]]:
    mode = c.get("mode", "crash")
    if mode not in MODES:
        return False, f"unknown mode {mode!r}; valid: {', '.join(MODES)}", {}
    try:
        node, slot = resolve_target(sup, str(c.get("target", "")))
    except InjectError as e:
        return False, str(e), {}
    at_step = c.get("at_step")
    t = time.time()
    info = {"mode": mode, "node": node, "slot": slot, "at_step": at_step, "t": t, "immediate": at_step is None}
    slots = [slot] if slot is not None else list(range(sup.nproc))
    if at_step is not None or mode in ("comm", "gpu-ecc", "pcie"):
        for s in slots:
            P.Queue(sup.store, P.q_rank(node, s)).put({"mode": mode, "at_step": at_step, "id": c.get("id")})
        when = f"at step {at_step}" if at_step is not None else "now"
        info["immediate"] = at_step is None and mode == "comm"
        return True, f"armed {mode} on {node}{'' if slot is None else f' slot {slot}'} {when}", info
    if mode == "crash" and slot is None:
        sup.backend.kill_node(node)
        if sup.nodes[node].group_rank is None:
            info["immediate"] = False  # a spare holds no rank: its loss is a spare_lost, not an incident to classify
        return True, f"SIGKILLed node {node} (its agent and {sup.nproc} rank(s))", info
    P.Queue(sup.store, P.q_agent(node)).put({"cmd": "inject", "mode": "rank" if mode == "crash" else mode, "slot": slot})
    what = {"crash": "SIGKILL", "rank": "SIGKILL", "hang": "SIGSTOP"}[mode]
    return True, f"{what} sent to {node} {'every rank' if slot is None else f'slot {slot}'}", info


def send_command(run_dir: Path, cmd: dict[str, Any], token: str | None = None, timeout_s: float = 10.0) -> dict[str, Any]:
    """Client side: put a token-authenticated command on the job's control plane and wait for the reply."""
    from phoenix_launch.control import connect
    from phoenix_launch.events import read_token

    ctl = json.loads((run_dir / "control.json").read_text())
    if token is None:
        try:
            token = read_token(run_dir)
        except OSError as e:
            raise InjectError(f"cannot read the job's token in {run_dir}: {e.strerror}") from None
    try:
        store = connect(ctl["host"], int(ctl["port"]), timeout_s=3.0)
    except Exception:
        raise InjectError(f"no running job at {ctl['host']}:{ctl['port']} (run directory {run_dir})") from None
    cid = uuid.uuid4().hex
    P.Queue(store, P.Q_COMMANDS).put({**cmd, "token": token, "id": cid})
    key = f"phx/reply/{cid}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if store.check([key]):
                return json.loads(store.get(key))
        except Exception:
            raise InjectError("the job stopped before it answered") from None
        time.sleep(0.02)
    raise InjectError(f"the job did not answer within {timeout_s:g} s")
