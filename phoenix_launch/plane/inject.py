"""Failure injection: ``phoenix-run kill-node`` (the client) and its execution (the supervisor's command
handler calls :func:`execute_injection` with a narrow :class:`JobTargets` view of the job).

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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping

from phoenix_launch.plane import command_socket
from phoenix_runtime.plane import protocol
from phoenix_runtime.errors import UsageError
from phoenix_runtime.plane.settings import FAULT_MODES, FAULT_PHASES

MODES = FAULT_MODES
SOCKET_PURPOSE = "phoenix command socket"  # the command socket's token is derived from the secret for it


class InjectError(UsageError, RuntimeError):
    pass


@dataclass(frozen=True)
class JobTargets:
    """What an injection needs to know about the running job, and the two ways it acts on it."""

    world_size: int
    nproc: int
    members: Callable[[], protocol.Membership]  # the current membership
    node_states: Callable[[], Mapping[str, str]]  # node -> its lifecycle state's value
    holds_ranks: Callable[[str], bool]  # the node is active (not a spare)
    store: protocol.Store
    kill_node: Callable[[str], None]  # the backend's: SIGKILL the node's agent and ranks


def resolve_target(job: JobTargets, target: str) -> tuple[str, int | None]:
    """TARGET is a node name or ``rank:R``; returns (node, slot or None for the whole node)."""
    if target.startswith("rank:"):
        try:
            r = int(target.split(":", 1)[1])
        except ValueError:
            raise InjectError(f"bad target {target!r}: use rank:R with an integer R") from None
        if not 0 <= r < job.world_size:
            raise InjectError(f"no rank {r} in this job (world size {job.world_size})")
        rs = job.members().slot_of(r)
        return rs.node, rs.slot
    states = job.node_states()
    if target not in states:
        raise InjectError(f"no node {target!r} in this job; nodes: {', '.join(states)}")
    if states[target] in ("failed", "drained", "stopped"):
        raise InjectError(f"node {target} is {states[target]}; nothing to inject")
    return target, None


def execute_injection(job: JobTargets, c: protocol.KillCommand) -> tuple[bool, str, dict[str, Any]]:
    """Carry out one ``kill-node`` command; returns (ok, the reply's message, the ``injected`` event's fields;
    ``immediate``: its effect is due now, so an incident opens at once)."""
    mode = c.mode
    if mode not in MODES:
        return False, f"unknown mode {mode!r}; valid: {', '.join(MODES)}", {}
    try:
        node, slot = resolve_target(job, c.target)
    except InjectError as e:
        return False, str(e), {}
    at_step = c.at_step
    t = time.time()
    info = {"mode": mode, "node": node, "slot": slot, "at_step": at_step, "t": t, "immediate": at_step is None and c.phase is None}
    slots = [slot] if slot is not None else list(range(job.nproc))
    if mode == "slow" and not (c.factor and c.factor > 1):
        return False, f"mode slow needs --factor F > 1, got {c.factor}", {}
    if c.phase is not None and c.phase not in FAULT_PHASES:
        return False, f"unknown phase {c.phase!r}; valid: {', '.join(FAULT_PHASES)}", {}
    if at_step is not None or c.phase is not None or mode in ("comm", "gpu-ecc", "pcie", "late", "slow", "sdc"):
        for s in slots:
            protocol.Queue(job.store, protocol.q_rank(node, s)).put(
                protocol.RankFault(mode, at_step, c.id, tensor=c.tensor, bit=c.bit, factor=c.factor, phase=c.phase))
        protocol.notify_ranks(job.store, queued=True)  # no state: every relay reads its batch (the queues' counters)
        info["phase"] = c.phase
        info["immediate"] = at_step is None and c.phase is None and mode == "comm"
        when = (f"at step {at_step}" if at_step is not None else "now" if c.phase is None else "at the next step")
        when += f" in phase {c.phase}" if c.phase is not None else ""
        return True, f"armed {mode} on {node}{'' if slot is None else f' slot {slot}'} {when}", info
    if mode == "crash" and slot is None:
        job.kill_node(node)
        if not job.holds_ranks(node):
            info["immediate"] = False  # a spare holds no rank: its loss is a spare_lost, not an incident to classify
        return True, f"SIGKILLed node {node} (its agent and {job.nproc} rank(s))", info
    protocol.tell_agent(job.store, node, protocol.AgentInject("rank" if mode == "crash" else mode, slot))
    what = {"crash": "SIGKILL", "rank": "SIGKILL", "hang": "SIGSTOP"}[mode]
    return True, f"{what} sent to {node} {'every rank' if slot is None else f'slot {slot}'}", info


def send_command(run_dir: Path, cmd: protocol.KillCommand, timeout_s: float = 10.0) -> dict[str, Any]:
    """Client side: put a command authenticated with the job's secret (``run_dir/secret``, readable only by
    the job's user) on the job's control plane and wait for the reply."""
    from phoenix_launch.plane.control import connect
    from phoenix_runtime.plane import auth

    ctl = json.loads((run_dir / "control.json").read_text())
    try:
        auth.set_key(auth.read_secret(run_dir))
    except (OSError, ValueError) as e:
        raise InjectError(f"cannot read the job's secret in {run_dir}: {getattr(e, 'strerror', None) or e}") from None
    token = auth.derive(SOCKET_PURPOSE)
    cid = uuid.uuid4().hex
    try:  # the run directory's unix socket (no torch import); the store only for a supervisor elsewhere
        reply = command_socket.send(run_dir, ctl, replace(cmd, token=token, id=cid).to_dict(), timeout_s)
        if reply is None:
            command_socket.probe_store(ctl["host"], int(ctl["port"]), run_dir)
    except command_socket.JobUnreachable as e:
        raise InjectError(str(e)) from None
    if reply is not None:
        return reply
    try:
        store = connect(ctl["host"], int(ctl["port"]), timeout_s=3.0)
    except Exception:  # noqa: BLE001 -- any failure to connect is "no running job"
        raise InjectError(f"no running job at {ctl['host']}:{ctl['port']} (run directory {run_dir})") from None
    store = protocol.Incarnated(store, int(ctl.get("incarnation", 0) or 0))  # a leader after a takeover seals for it
    protocol.Queue(store, protocol.Q_COMMANDS).put(replace(cmd, id=cid))  # sealed; no token in the store
    key = f"phx/reply/{cid}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            text = protocol.get_value(store, key)  # a forged reply is refused: the genuine one is waited for
            if text is not None:
                return json.loads(text)
        except Exception:  # noqa: BLE001 -- a store that went away or an answer cut short
            raise InjectError("the job stopped before it answered") from None
        time.sleep(0.02)
    raise InjectError(f"the job did not answer within {timeout_s:g} s")


class Chaos:
    """Seeded chaos for soak runs: a node crash at exponentially distributed times (``inject.chaos_mtbf_s``),
    on any active node or only on those holding ``ranks`` (``inject.chaos_ranks``: a soak keeps survivors)."""

    def __init__(self, mtbf_s: float, seed: int, ranks: tuple[int, ...] = ()):
        import random

        self.mtbf_s = mtbf_s
        self.ranks = ranks
        self.rng = random.Random(seed)
        self.next_t: float | None = None

    def victim(self, now: float, active: list[str], members: protocol.Membership | None = None,
               finishing: Callable[[], bool] = lambda: False) -> str | None:
        """The node to crash now, or None (not due yet, chaos off, no active node, or the ranks have finished
        their training loop: a crash in the script's own code after the loop is outside any step guard)."""
        if self.mtbf_s <= 0:
            return None
        if self.next_t is None:
            self.next_t = now + self.rng.expovariate(1.0 / self.mtbf_s)
        if now < self.next_t:
            return None
        self.next_t = now + self.rng.expovariate(1.0 / self.mtbf_s)
        if self.ranks and members is not None:
            held = {members.slot_of(r).node for r in self.ranks if r < members.world_size}
            active = [n for n in active if n in held]
        if not active or finishing():
            return None
        return self.rng.choice(sorted(active))
