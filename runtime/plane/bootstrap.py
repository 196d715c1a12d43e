"""Rank bootstrap: ``python -m phoenix_runtime.plane.bootstrap [-m MODULE | SCRIPT] ARGS...``.

Runs inside every rank process that ``phoenix-run`` starts, before the user's code:
1. imports torch and joins the control plane (heartbeat, generation watch) -- the runtime is injected;
2. a spare blocks here, warm, until the supervisor assigns it a logical rank, then takes the torchrun
   environment of that rank (RANK, WORLD_SIZE, ...) and marks itself as joining;
3. runs the script with ``runpy`` (``python script.py`` and ``-m module`` both work), recording an uncaught
   exception to the error file in torchrun's ``@record`` format (plus type, message and step), so that the
   supervisor classifies from facts;
4. exits without running the interpreter's teardown of live process groups (seen here: gloo's destructor
   can deadlock at exit while DDP holds the group), after running the script's atexit handlers.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta

from phoenix_runtime.plane import auth, protocol
from phoenix_runtime import logs
from phoenix_runtime.errors import UsageError
from phoenix_runtime.plane import rank_env as rank_env_module

log = logging.getLogger("phoenix_runtime.plane.bootstrap")  # by name: this module runs as __main__


def write_error_file(exc: BaseException, step: int | None) -> None:
    env = rank_env_module.rank_env()
    path = env.error_file
    if not path:
        return
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    data = {
        # torchrun's format (torch.distributed.elastic.multiprocessing.errors)
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {"py_callstack": tb, "timestamp": str(int(time.time()))},
        },
        # PHOENIX's fields
        "phoenix": {
            "type": type(exc).__name__,
            "message": str(exc),
            "traceback": tb,
            "step": step,
            "rank": _current_rank(env),
            "time": time.time(),
        },
    }
    tmp = f"{path}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # a leftover (or a planted link): the new file is made afresh, 0600, never through a link
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _current_rank(env) -> int | None:
    """The rank in the current generation (the context's, once ``phx.init()`` ran), None for a spare."""
    from phoenix_runtime.plane import context

    ctx = context.current() if "torch" in sys.modules else None
    if ctx is not None:
        return ctx.rank
    return env.rank if env.role == protocol.ROLE_ACTIVE else None


def wait_for_assignment(poll_s: float = 0.01, wake_s: float = 1.0) -> dict:
    """A spare's warm wait: torch imported, connected, heartbeating; returns the assignment.

    A daemon thread blocks in the store on the assignment's key (``_AssignmentWaiter``) and wakes this thread
    when the key appears: the assignment is read at once, and a spare that waits for days makes one store call
    a second (``wake_s``), not a hundred. That call is a ``check``, and the key is read only once it exists: a
    read of an absent key by ``compare_set`` (``channel.read_raw``) wakes the store's waiters on it as if it had
    been written (torch's libuv ``TCPStore``, ``compareAndSet``), which would end the waiter and leave the spare
    polling every ``poll_s``. This thread waits on an event, not in the store, so that SIGTERM's
    handler runs at once. Once a value was refused (a forged assignment, reported), or when the waiter has no
    store, it polls every ``poll_s`` until the supervisor's own is there."""
    from phoenix_runtime.plane.control import connect_store, hand_over

    env = rank_env_module.rank_env()
    store = connect_store(env)
    key = protocol.k_assign(env.node, env.slot)
    waiter = _AssignmentWaiter(key)
    try:
        while True:
            text = protocol.get_value(store, key) if waiter.done.is_set() or store.check([key]) else None
            if text is not None:
                hand_over(store)  # the joiner's Context uses this connection: no new one on the recovery's path
                return json.loads(text)
            if waiter.done.is_set():  # the key is there but was refused, or the waiter has no store: poll
                time.sleep(poll_s)
            else:
                waiter.done.wait(wake_s)
    finally:
        waiter.stop.set()


class _AssignmentWaiter:
    """Blocks in the store (a client of its own) until ``key`` exists, then sets ``done`` (also when it
    cannot wait there: the spare then polls)."""

    WAIT_S = 3600.0  # as control.NotifyWatcher's: a wait that times out costs two torch warning lines

    def __init__(self, key: str):
        self.key = key
        self.done, self.stop = threading.Event(), threading.Event()
        threading.Thread(target=self._run, name="phoenix-assign", daemon=True).start()

    def _run(self) -> None:
        from phoenix_runtime.plane.control import connect_store  # as wait_for_assignment's (control imports torch)

        try:
            store = connect_store()
            while not self.stop.is_set():
                try:
                    if store.wait_or_move([self.key], timedelta(seconds=self.WAIT_S)) and store.check([self.key]):
                        break  # there (a wait also ends at a compare_set of the absent key: see wait_for_assignment)
                except Exception as e:  # noqa: BLE001 - a timeout: wait again; else the spare polls
                    if "timeout" not in str(e).lower():
                        return
        except Exception:  # noqa: BLE001 - no store of its own: the spare polls
            return
        finally:
            self.done.set()


def assignment_env(assignment: dict) -> dict[str, str]:
    """The variables of an assignment a spare applies: only the launcher's own keys (an environment from the
    network could, e.g., point TORCHELASTIC_ERROR_FILE anywhere); any other is dropped and refused."""
    allowed = protocol.assignment_env_keys()
    env = {str(k): str(v) for k, v in dict(assignment.get("env") or {}).items()}
    if any(k not in allowed for k in env):
        auth.refuse("env", protocol.k_assign(rank_env_module.rank_env().node, rank_env_module.rank_env().slot))
    return {k: v for k, v in env.items() if k in allowed}


def prewarm(argv: list[str]) -> None:
    """A spare's wait is free time: import what the script will need (the runtime, DDP, ZeRO, and the
    installed packages its top-level imports name), so that a replacement starts with none of that."""
    import ast
    import importlib
    import importlib.util

    for mod in ("phoenix_runtime.api", "phoenix_runtime.protection.snapshot", "phoenix_runtime.protection.replication",
                "torch.nn.parallel", "torch.distributed.optim", "torch.distributed.checkpoint",
                "torch._inductor.config"):  # torch.use_deterministic_algorithms() imports it: seconds
        try:
            importlib.import_module(mod)
        except Exception:
            pass
    if not argv or argv[0] == "-m":
        return
    script_dir = os.path.dirname(os.path.abspath(argv[0]))
    try:
        tree = ast.parse(open(argv[0]).read())
    except (OSError, SyntaxError, ValueError):
        return
    names = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    for name in names:
        try:
            spec = importlib.util.find_spec(name.split(".")[0])
            origin = getattr(spec, "origin", None) or ""
            if spec is None or origin.startswith(script_dir) or origin.startswith(os.getcwd() + os.sep):
                continue  # the user's own modules: importing them early could run their code twice
            importlib.import_module(name)
        except Exception:
            continue


def signal_warm() -> None:
    """Tell the agent that this rank is warm (see protocol.ENV_WARM_FD); once, and not inherited further."""
    fd = os.environ.pop(protocol.ENV_WARM_FD, None)  # not inherited by the script's own children
    if not fd:
        return
    try:
        os.write(int(fd), b"w")
        os.close(int(fd))
    except (OSError, ValueError):
        pass


def _run_user_code(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("phoenix bootstrap: no script given")
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit("phoenix bootstrap: -m needs a module name")
        sys.argv = [argv[1], *argv[2:]]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = argv[0]
        sys.argv = [script, *argv[1:]]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")


def main() -> None:
    argv = sys.argv[1:]
    import torch  # noqa: F401  (warm: the script's own import is then free)

    from phoenix_runtime.plane.control import start_control
    from phoenix_runtime.plane.rank_status import process_status

    status = process_status()  # the Context's once the script calls phx.init()
    logs.configure_rank()
    role = rank_env_module.rank_env().role
    auth.key()  # the job's secret, out of the environment before the user's script can see it
    start_control()
    signal_warm()  # a spare too: its prewarm below is its own business, the agent need not wait for it
    if role == protocol.ROLE_SPARE:
        prewarm(argv)
        log.info("spare warm: waiting for an assignment")
        assignment = wait_for_assignment()
        log.info(f"spare assigned rank {assignment['rank']} in generation {assignment['gen']}")
        # the user's script may read torchrun's variables: the assignment goes into the environment, which
        # is then parsed again (the one place the runtime writes it)
        os.environ.update(assignment_env(assignment))
        os.environ[protocol.ENV_GEN] = str(assignment["gen"])
        os.environ[protocol.ENV_JOINING] = "1"
        os.environ[protocol.ENV_ROLE] = protocol.ROLE_ACTIVE
        rank_env_module.reload()
        status.gen = int(assignment["gen"])
        status.enter("starting")
    code = 0
    try:
        _run_user_code(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = 130
    except UsageError as e:  # bad input the user can fix (phx.init refused the layout): one line, no traceback
        write_error_file(e, status.step if status.step >= 0 else None)
        print(f"phoenix: {e}", file=sys.stderr)
        code = 2
    except BaseException as e:  # noqa: BLE001 -- recorded, printed once, then a non-zero exit
        write_error_file(e, status.step if status.step >= 0 else None)
        traceback.print_exc()
        code = 1
    if status.phase != "finished":  # the loop's completion stays visible until the process is gone
        status.enter("done")
    _exit(code)


def _exit(code: int) -> None:
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda s, f: _exit(128 + s))
    main()
