"""The command handler: ``phoenix-run kill-node`` requests, authenticated by the job's secret.

Through the store (``protocol.Q_COMMANDS``) a command is sealed with the secret like every message (the
queue refuses any other); through the run directory's unix socket (0600, in the 0700 run directory) it
carries a token derived from the secret (``auth.derive(SOCKET_PURPOSE)``), never the secret itself.

It sees the job only through :class:`~phoenix_launch.plane.inject.JobTargets` and tells the supervisor about an
injection whose effect is due now through ``on_injected`` (an incident opens before anything is observed).
"""

from __future__ import annotations

import hmac
import json
from typing import Any, Callable

from phoenix_launch.observe.events import EventLog
from phoenix_launch.plane.inject import JobTargets, execute_injection
from phoenix_runtime.plane import protocol


def reply_key(command_id: str) -> str:
    return f"phx/reply/{command_id}"


class CommandHandler:
    def __init__(self, store: protocol.Store, token: str | None, events: EventLog, job: JobTargets,
                 on_injected: Callable[[str, float, float], None]):
        self.store = store
        self.token = token  # None: the commands come through the store, sealed (checked by the queue)
        self.events = events
        self.job = job
        self.on_injected = on_injected  # (mode, t_kill, now)
        self.dispatcher = protocol.Dispatcher({protocol.MsgType.KILL: self._kill})

    def handle(self, raw: dict[str, Any], now: float) -> None:
        if self.dispatcher.dispatch(raw, now) is None:
            self.events.emit("command_refused", command=raw.get("type"), reason="unknown or malformed command")
            self._reply(str(raw.get("id", "none")), False, "refused: unknown or malformed command")

    def _kill(self, c: protocol.KillCommand, now: float) -> None:
        if self.token is not None and not hmac.compare_digest(str(c.token), self.token):
            self.events.emit("command_refused", command=c.TYPE.value, reason="bad or missing token")
            self._reply(c.id, False, "refused: the job's token does not match")
            return
        ok, msg, info = execute_injection(self.job, c)
        self._reply(c.id, ok, msg, usage=not ok)  # every refusal of ``execute_injection`` is of the command's input
        if ok:
            self.events.emit("injected", **info)
            if info.get("immediate"):
                self.on_injected(info["mode"], info["t"], now)

    def _reply(self, command_id: str, ok: bool, msg: str, usage: bool = False) -> None:
        """``usage``: refused for its input (a target, mode or phase the job has not): kill-node exits 2, as for any
        bad input; other refusals (a token, a job that did not answer) exit 1."""
        reply = json.dumps({"ok": ok, "message" if ok else "error": msg, **({"usage": True} if usage else {})})
        if self.token is None:
            protocol.put_value(self.store, reply_key(command_id), reply)  # sealed: kill-node checks it
        else:
            self.store.set(reply_key(command_id), reply)
