"""The interpreter: the one place the supervisor's effects (``effects.py``) meet the world -- the control-plane
store, the backend, the event log, the standby link and the control plane's rendezvous.

It is the outbox's sink in a running job (each effect applied as the step adds it) and in the in-process harness
(``tests/test_step.py``: a ``HashStore``, a fake backend, a list of events).
"""

from __future__ import annotations

from typing import Any, Callable

from phoenix_launch import effects as fx
from phoenix_runtime.plane import protocol


class Interpreter:
    """``store``: () -> the store (None before the control plane serves); ``before_bump``: the standby holds a
    new generation before any rank can see it; ``rendezvous``: opens a new one, (host, port); ``agent_reached`` and
    ``adopt``: the supervisor's edge (the standby link, the replenisher)."""

    def __init__(
        self,
        events: Any,
        backend: Any,
        store: Callable[[], Any],
        *,
        before_bump: Callable[[], None] = lambda: None,
        rendezvous: Callable[[], tuple[str, int]] | None = None,
        agent_reached: Callable[[str], None] = lambda node: None,
        adopt: Callable[[protocol.AgentUp], None] = lambda m: None,
    ):
        self.events, self.backend, self.store = events, backend, store
        self.before_bump, self.rendezvous = before_bump, rendezvous
        self.agent_reached, self.adopt = agent_reached, adopt

    def apply(self, e: fx.Effect) -> Any:
        if isinstance(e, fx.Emit):
            self.events.emit(e.event)
        elif isinstance(e, fx.PublishGeneration):
            self.publish(e)
        elif isinstance(e, fx.PutMembers):
            protocol.put_members(self.store(), e.members)
        elif isinstance(e, fx.PutValue):
            protocol.put_value(self.store(), e.key, e.value)
            if e.notify:
                protocol.notify_ranks(self.store())
        elif isinstance(e, fx.TellAgent):
            protocol.tell_agent(self.store(), e.node, e.message)
        elif isinstance(e, fx.NewRendezvous):
            assert self.rendezvous is not None, "a restart needs the control plane's rendezvous"
            return self.rendezvous()
        elif isinstance(e, fx.RestartAgents):
            for name, group in e.nodes:
                protocol.tell_agent(
                    self.store(),
                    name,
                    protocol.AgentRestart(e.epoch, e.port, group, e.world_size, e.gen, protocol.ROLE_ACTIVE, e.resume),
                )
        elif isinstance(e, fx.KillNode):
            self.backend.kill_node(e.node)
        elif isinstance(e, fx.DrainNode):
            return self.backend.drain(e.node, e.why)
        elif isinstance(e, fx.DeleteKeys):
            self.delete(e.keys)
        elif isinstance(e, fx.AgentReached):
            self.agent_reached(e.node)
        elif isinstance(e, fx.Adopt):
            self.adopt(e.message)
        else:
            raise TypeError(f"no interpretation of {type(e).__name__}")
        return None

    def publish(self, e: fx.PublishGeneration) -> None:
        """Membership first, then the difference, then the joiners' assignments, the standby, the bump."""
        store, mem = self.store(), e.members
        protocol.put_members(store, mem)
        protocol.put_value(store, protocol.k_members_diff(mem.gen), e.diff)
        for node, slot, assignment in e.assignments:
            protocol.put_value(store, protocol.k_assign(node, slot), assignment)
        self.before_bump()
        protocol.put_value(store, protocol.K_GEN, str(mem.gen))
        protocol.notify_ranks(store)
        # the generation before is given up unless every rank arrived there (then it is "go" already): its ranks
        # that wait for its fate learn it now, in the same round trip that waits (``Context._wait_all``)
        store.compare_set(protocol.k_fate(mem.gen - 1), "", "cancel")

    def delete(self, keys: tuple[str, ...]) -> None:
        delete = getattr(self.store(), "delete_key", None)
        if delete is None:  # a store without deletes keeps them
            return
        for key in keys:
            try:
                delete(key)
            except Exception:  # noqa: BLE001 -- a key already gone
                pass
