"""Issue 16, section 2: only the job may steer the job.

Pure tests of the signing module (tamper, replay, wrong key, the assignment's allow-list), and one real job
(examples/train_gpt.py, 2 nodes x 2 ranks + 1 spare) whose store a plain ``TCPStore`` client without the
secret attacks with every forgery the issue lists: the job completes with the failure-free digest, nothing
happens to it, and each forgery is a ``refused`` event in its events.jsonl.
"""

from __future__ import annotations

import json
import os
import stat
import time
from datetime import timedelta
from pathlib import Path

import pytest

from conftest import EXAMPLES, assert_same_digest, events, job_processes, kill_job, load_digest, of_type, run_phoenix, start_phoenix, wait_for
from phoenix_runtime.plane import auth, protocol

GPT = str(EXAMPLES / "train_gpt.py")


# --- the signing module ----------------------------------------------------------------------------
@pytest.fixture
def secret():
    auth.set_key(b"k" * 32)
    auth.drain()
    yield
    auth.drain()


@pytest.mark.timeout(30)
def test_sealed_values_open_and_tampered_ones_are_refused(secret):
    sealed = auth.seal("phx/q/agent/n0", 3, '{"type": "stop"}')
    assert auth.unseal("phx/q/agent/n0", sealed, 3) == (3, '{"type": "stop"}')
    assert auth.unseal("phx/q/agent/n0", sealed.encode(), 3)[1] == '{"type": "stop"}'  # bytes, as a store gives
    cases = {
        "unsigned": ('{"type": "stop"}', "phx/q/agent/n0", 3),
        "forged": (sealed.replace("stop", "inject"), "phx/q/agent/n0", 3),  # altered payload
        "forged ": (sealed, "phx/q/agent/n1", 3),  # moved to another node's queue
        "replayed": (sealed, "phx/q/agent/n0", 4),  # the same queue, another slot
    }
    for kind, (raw, name, seq) in cases.items():
        with pytest.raises(auth.Refused) as e:
            auth.unseal(name, raw, seq)
        assert e.value.kind == kind.strip()
    assert {(r["kind"], r["key"], r["count"]) for r in auth.drain()} == {
        ("unsigned", "phx/q/agent/n0", 1), ("forged", "phx/q/agent/n0", 1), ("forged", "phx/q/agent/n1", 1),
        ("replayed", "phx/q/agent/n0", 1)}
    assert auth.drain() == []  # drained once


@pytest.mark.timeout(30)
def test_a_wrong_key_is_refused_and_no_key_neither_signs_nor_checks(secret):
    sealed = auth.seal("phx/gen", 1, "5")
    auth.set_key(b"x" * 32)
    with pytest.raises(auth.Refused) as e:
        auth.unseal("phx/gen", sealed)
    assert e.value.kind == "forged"
    auth.set_key(None)  # the runtime outside phoenix-run: no control plane to guard
    assert auth.seal("phx/gen", 1, "5") == "5" and auth.unseal("phx/gen", "5") == (0, "5")


@pytest.mark.timeout(30)
def test_queue_drops_forged_messages_and_keys_refuse_replays(secret):
    from test_pure import DictStore

    st = DictStore()
    q = protocol.Queue(st, "phx/q/agent/n0")
    q.put(protocol.AgentStop())
    genuine = st.get("phx/q/agent/n0/1")
    n = st.add("phx/q/agent/n0/n", 1)
    st.set(f"phx/q/agent/n0/{n}", genuine)  # a captured genuine message, replayed
    n = st.add("phx/q/agent/n0/n", 1)
    st.set(f"phx/q/agent/n0/{n}", json.dumps({"type": "inject", "mode": "rank", "slot": 0}))  # unsigned
    q.put(protocol.AgentInject("hang", 1))
    got = protocol.Queue(st, "phx/q/agent/n0").get_all()
    assert [m["type"] for m in got] == ["stop", "inject"] and got[1]["mode"] == "hang"
    assert {(r["kind"], r["count"]) for r in auth.drain()} == {("replayed", 1), ("unsigned", 1)}
    # a single-valued key: an older genuine value written back is refused, the newest genuine one is kept
    protocol.put_value(st, protocol.K_GEN, "1")
    old = st.get(protocol.K_GEN)
    protocol.put_value(st, protocol.K_GEN, "2")
    genuine = st.get(protocol.K_GEN)
    assert protocol.read_gen(st) == 2
    st.set(protocol.K_GEN, old)
    assert protocol.read_gen(st) == 2
    st.set(protocol.K_GEN, "9")
    assert protocol.read_gen(st) == 2
    assert {(r["kind"], r["key"]) for r in auth.drain()} == {("replayed", protocol.K_GEN), ("unsigned", protocol.K_GEN)}
    # a writer that takes the key over (a clock an hour behind) continues the sequence: not a replay
    ahead = auth.unseal(protocol.K_GEN, genuine)[0] + 3600 * 10**9
    auth.continue_after(ahead)
    protocol.put_value(st, protocol.K_GEN, "3")
    assert protocol.read_gen(st) == 3 and auth.drain() == []


@pytest.mark.timeout(30)
def test_the_control_thread_polls_one_counter_and_a_forged_one_hides_nothing(secret):
    """A rank's control thread reads the generation, the persist step and its queue only when protocol.K_NOTIFY
    moved (or every heartbeat): a quiet poll is one round trip. A forged bump costs one full read; a forged
    decrease or a non-integer counter delays nothing past the periodic full read; a message reserved but not
    written yet is read again at the next poll without a new bump."""
    from test_pure import DictStore

    from phoenix_runtime.plane.control import ControlThread

    class Counting(DictStore):
        calls = 0

        def __getattribute__(self, name):
            if name in ("set", "get", "add", "check", "compare_set"):
                type(self).calls += 1
            return super().__getattribute__(name)

    st = Counting()
    ctl = ControlThread.__new__(ControlThread)  # no thread, no TCPStore: _poll is called by hand
    ctl.store, ctl.q_rank, ctl.latest_gen, ctl.persist_at = st, protocol.Queue(st, protocol.q_rank("n0", 0)), 0, -1
    ctl._notified, ctl._dirty, ctl.on_fault, ctl._incarnation = None, True, [], 0
    seen_gens: list[int] = []
    ctl.on_gen_change = [seen_gens.append]
    faults: list[dict] = []
    ctl.on_fault.append(faults.append)
    ctl._poll(full=False)  # the first poll reads everything
    Counting.calls = 0
    ctl._poll(full=False)
    assert Counting.calls == 1  # a quiet poll: the counter alone
    protocol.put_value(st, protocol.K_GEN, "1")
    protocol.notify_ranks(st)
    ctl._poll(full=False)
    assert seen_gens == [1] and ctl.latest_gen == 1
    protocol.Queue(st, protocol.q_rank("n0", 0)).put(protocol.RankFault("rank", 5))
    protocol.put_value(st, protocol.K_PERSIST_AT, "40")
    protocol.notify_ranks(st)
    ctl._poll(full=False)
    assert [m["mode"] for m in faults] == ["rank"] and ctl.persist_at == 40
    # a forged bump: one full read that finds nothing new
    st.add(protocol.K_NOTIFY, 1)
    ctl._poll(full=False)
    assert seen_gens == [1] and len(faults) == 1
    # a forged decrease that a genuine bump brings back to the value already seen: the periodic full read finds it
    st.add(protocol.K_NOTIFY, -1)
    protocol.put_value(st, protocol.K_GEN, "2")
    protocol.notify_ranks(st)
    ctl._poll(full=False)
    assert seen_gens == [1]
    ctl._poll(full=True)
    assert seen_gens == [1, 2]
    # a reserved-but-unwritten message holds the queue: the next polls read it again until it is written
    q = protocol.q_rank("n0", 0)
    n = st.add(f"{q}/n", 1)
    protocol.notify_ranks(st)
    ctl._poll(full=False)
    assert ctl._dirty and len(faults) == 1
    st.set(f"{q}/{n}", auth.seal(q, n, json.dumps({"v": 1, "type": "fault", "mode": "comm"})))
    ctl._poll(full=False)  # no bump since
    assert [m["mode"] for m in faults] == ["rank", "comm"] and not ctl._dirty
    # a counter that is not a number (a plain client's set): every poll reads everything
    st.set(protocol.K_NOTIFY, "x")
    protocol.put_value(st, protocol.K_GEN, "3")
    ctl._poll(full=False)
    assert seen_gens == [1, 2, 3]
    assert auth.drain() == []


@pytest.mark.timeout(60)
def test_a_bump_wakes_the_control_thread_at_once_and_the_notify_keys_stay_few(secret):
    """Between heartbeats the control thread sleeps; its watcher, blocked in the store on the key of the counter's
    next value, wakes it when ``notify_ranks`` bumps it (well within a heartbeat, here 5 s). The supervisor keeps
    only the newest ``NOTIFY_KEEP`` of those keys."""
    from torch.distributed import TCPStore

    from phoenix_runtime.plane.control import ControlThread
    from phoenix_runtime.plane.rank_status import RankStatus
    from phoenix_runtime.plane.rank_env import RankEnv

    master = TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, timeout=timedelta(seconds=30))
    protocol.put_value(master, protocol.K_GEN, "0")
    env = RankEnv.from_environ({protocol.ENV_STORE_HOST: "127.0.0.1", protocol.ENV_STORE_PORT: str(master.port),
                                protocol.ENV_NODE: "node0", protocol.ENV_SLOT: "0", protocol.ENV_GEN: "0",
                                protocol.ENV_HEARTBEAT_S: "5", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    ctl = ControlThread(RankStatus(), env)
    try:
        seen: list[tuple[int, float]] = []
        ctl.on_gen_change.append(lambda g: seen.append((g, time.monotonic())))
        wait_for(lambda: ctl._watcher.armed, 20, "the notify watcher armed")
        for g in (1, 2, 3):
            wait_for(lambda: ctl.asleep_until - time.monotonic() > 1.0, 10,
                     "the control thread asleep until its next heartbeat (5 s)", interval=0.01)
            t = time.monotonic()
            protocol.put_value(master, protocol.K_GEN, str(g))
            protocol.notify_ranks(master)
            wait_for(lambda: len(seen) == g, 2, f"generation {g} seen")
            assert seen[-1][1] - t < 1.0
        for _ in range(3 * protocol.NOTIFY_KEEP):
            protocol.notify_ranks(master)
        n = int(master.add(protocol.K_NOTIFY, 0))
        kept = [i for i in range(1, n + 1) if master.check([protocol.k_notify(i)])]
        assert kept == list(range(n - protocol.NOTIFY_KEEP + 1, n + 1))
    finally:
        ctl.stop()


def _spare_store(monkeypatch):
    """A real store, and the environment of a spare ``spare0`` slot 0 that waits on it (``bootstrap.wait_for_assignment``)."""
    from torch.distributed import TCPStore

    from phoenix_runtime.plane import rank_env as rank_env_module

    master = TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, timeout=timedelta(seconds=30))
    for k, v in {protocol.ENV_STORE_HOST: "127.0.0.1", protocol.ENV_STORE_PORT: str(master.port), protocol.ENV_NODE: "spare0",
                 protocol.ENV_SLOT: "0", protocol.ENV_GEN: "0", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    rank_env_module.reload()
    return master


@pytest.mark.timeout(60)
def test_a_spare_sees_its_assignment_at_once_and_waits_out_a_forged_one(secret, monkeypatch):
    """The spare's warm wait blocks in the store (a waiter thread), not in a 10 ms poll: a genuine assignment is
    read well within ``wake_s`` (here 30 s, so that only the waiter can be what woke it). A forged one is refused
    (reported) and the spare goes on waiting, polling, until the supervisor's own comes."""
    import threading

    from phoenix_runtime.plane import bootstrap
    from phoenix_runtime.plane import rank_env as rank_env_module

    master = _spare_store(monkeypatch)
    key = protocol.k_assign("spare0", 0)
    try:
        for forged in (True, False):  # (a refused value reads as the last genuine one: the forged case first)
            got: list = []
            th = threading.Thread(target=lambda: got.append(bootstrap.wait_for_assignment(wake_s=30.0)), daemon=True)
            th.start()
            wait_for(lambda: any(w.name == "phoenix-assign" for w in threading.enumerate()), 10, "the spare's waiter")
            if forged:
                master.set(key, json.dumps({"rank": 9, "gen": 9, "env": {}}))  # unsigned
                wait_for(lambda: auth.drain(), 10, "the forged assignment refused")
                assert not got and th.is_alive()
            t = time.monotonic()
            protocol.put_value(master, key, json.dumps({"rank": 1, "gen": 2 + forged, "env": {}}))
            th.join(20)
            assert got and got[0]["gen"] == 2 + forged, got
            assert time.monotonic() - t < 5.0  # well within wake_s: the waiter woke it (or its poll, once refused)
            master.delete_key(key)
    finally:
        monkeypatch.undo()
        rank_env_module.reload()


@pytest.mark.timeout(60)
def test_a_spare_keeps_waiting_in_the_store_across_its_passes_not_polling(secret, monkeypatch):
    """A compare_set read of an absent key wakes torch's store waiters on that key (libuv ``compareAndSet``): the
    spare's pass each ``wake_s`` read its absent assignment that way, which ended its waiter thread at the second
    pass, and from then on the spare polled the store a hundred times a second, for as long as it stayed a spare.
    Its passes only ``check`` the key now: after 20 of them the waiter is still blocked in the store, no pass read
    the absent key, and the assignment is taken as soon as it is written."""
    import threading

    from phoenix_runtime.plane import bootstrap, control
    from phoenix_runtime.plane import rank_env as rank_env_module

    master = _spare_store(monkeypatch)
    calls: list[tuple[str, str]] = []  # (the calling thread, the store method)

    class Counted:  # the spare's own clients, each call recorded
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            f = getattr(self.inner, name)
            if not callable(f):
                return f
            return lambda *a, **k: (calls.append((threading.current_thread().name, name)), f(*a, **k))[1]

    real = control.connect_store
    monkeypatch.setattr(control, "connect_store", lambda *a, **k: Counted(real(*a, **k)))
    monkeypatch.setattr(control, "_HANDED", None)
    key = protocol.k_assign("spare0", 0)
    try:
        got: list = []
        th = threading.Thread(target=lambda: got.append(bootstrap.wait_for_assignment(wake_s=0.02)), name="spare", daemon=True)
        th.start()
        wait_for(lambda: ("phoenix-assign", "wait_or_move") in calls, 10, "the spare's waiter blocked in the store")
        wait_for(lambda: calls.count(("spare", "check")) >= 20, 10, "20 passes of the spare")
        assert any(w.name == "phoenix-assign" for w in threading.enumerate()), calls[-10:]
        assert ("spare", "compare_set") not in calls, calls[-10:]  # the absent key was never read
        assert not got and th.is_alive()
        protocol.put_value(master, key, json.dumps({"rank": 1, "gen": 2, "env": {}}))
        th.join(20)
        assert got and got[0]["gen"] == 2, got
    finally:
        master.delete_key(key)
        monkeypatch.undo()
        rank_env_module.reload()


@pytest.mark.timeout(30)
def test_an_assignment_sets_only_the_launchers_variables(secret, monkeypatch):
    from phoenix_runtime.plane import bootstrap
    from phoenix_runtime.plane import rank_env as rank_env_module

    monkeypatch.setenv(protocol.ENV_NODE, "spare0")
    monkeypatch.setenv(protocol.ENV_SLOT, "1")
    rank_env_module.reload()
    env = bootstrap.assignment_env({"rank": 3, "gen": 2, "env": {"RANK": 3, "WORLD_SIZE": "4", protocol.ENV_RESUME: "",
                                                                  "TORCHELASTIC_ERROR_FILE": "/tmp/x", "LD_PRELOAD": "/tmp/y.so"}})
    assert env == {"RANK": "3", "WORLD_SIZE": "4", protocol.ENV_RESUME: ""}
    assert auth.drain() == [{"kind": "env", "key": protocol.k_assign("spare0", 1), "count": 1}]
    monkeypatch.delenv(protocol.ENV_NODE)
    monkeypatch.delenv(protocol.ENV_SLOT)
    rank_env_module.reload()


@pytest.mark.timeout(30)
def test_the_secret_file_is_new_private_and_never_follows_a_link(tmp_path):
    d = tmp_path / "run"
    from phoenix_launch.observe.events import private_dir, write_private

    private_dir(d)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    k = auth.create_secret(d)
    assert auth.read_secret(d) == k and stat.S_IMODE((d / "secret").stat().st_mode) == 0o600
    (tmp_path / "elsewhere").write_text("x")
    (d / "secret").unlink()
    os.symlink(tmp_path / "elsewhere", d / "secret")  # a planted link: replaced, never written through
    k2 = auth.create_secret(d)
    assert k2 != k and auth.read_secret(d) == k2 and not (d / "secret").is_symlink()
    assert (tmp_path / "elsewhere").read_text() == "x"
    os.symlink(tmp_path / "elsewhere", d / "status.json")
    write_private(d / "status.json", "{}")  # replaces the link itself, never writes through it
    assert (tmp_path / "elsewhere").read_text() == "x" and stat.S_IMODE((d / "status.json").stat().st_mode) == 0o600


# --- a real job attacked through its store ------------------------------------------------------------
def _job_args(run_dir: Path, digest: Path, spares: int, hold: Path | None = None) -> list[str]:
    """``hold``: while this file exists every step takes 2 s more (under the hang timeout), so the job outlives
    what the test does to it however slow the machine; removed, the job ends at full speed (the digest does not
    depend on it)."""
    extra = ["--step-sleep", "2.0", "--step-sleep-while", str(hold)] if hold is not None else []
    return ["--nodes", "2", "--nproc-per-node", "2", "--spares", str(spares), "--run-dir", str(run_dir), GPT,
            "--steps", "100", *extra, "--digest-file", str(digest)]


def _refused(run_dir: Path) -> set[tuple[str, str]]:
    return {(e["kind"], e["key"]) for e in of_type(events(run_dir), "refused")}


def _forge_until_refused(store, run_dir: Path, want: tuple[str, str], write, timeout: float = 60.0) -> None:
    """Write the forgery again (the genuine writer may overwrite it) until the job logs it as refused."""
    deadline = time.monotonic() + timeout
    while want not in _refused(run_dir):
        assert time.monotonic() < deadline, f"no refused event {want}; refused: {sorted(_refused(run_dir))}"
        write()
        time.sleep(0.1)


def _capture_queue_message(store, name: str, timeout: float = 30.0) -> bytes:
    """A genuine message of a queue, read between its writer's put and its reader's delete."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        n = store.add(f"{name}/n", 0)
        for k in (f"{name}/{n}", f"{name}/{n + 1}"):
            try:
                if store.check([k]):
                    return store.get(k)
            except Exception:  # deleted between check and get
                pass
        time.sleep(0.001)
    raise AssertionError(f"no genuine message of {name} captured")


@pytest.mark.slow
@pytest.mark.full  # a long real job; PHOENIX_FULL_MATRIX=1 runs it (the suite stays within its time)
@pytest.mark.timeout(600)
def test_a_plain_store_client_without_the_secret_cannot_steer_the_job(tmp_path):
    from torch.distributed import TCPStore

    base = tmp_path / "base"
    r = run_phoenix(_job_args(base / "run", base / "digest.json", 0), tmp_path, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    expected = load_digest(base / "digest.json", "failure-free run")
    assert not of_type(events(base / "run"), "refused")  # nothing genuine is ever refused
    assert stat.S_IMODE((base / "run").stat().st_mode) == 0o700
    for f in ("secret", "events.jsonl", "status.json", "control.json", "config.yaml"):
        assert stat.S_IMODE((base / "run" / f).stat().st_mode) == 0o600, f

    d = tmp_path / "attacked"
    run_dir, digest = d / "run", d / "digest.json"
    hold = tmp_path / "hold"
    hold.touch()
    proc = start_phoenix(_job_args(run_dir, digest, 1, hold), tmp_path)
    try:
        wait_for(lambda: any(e.get("step", 0) >= 2 for e in of_type(events(run_dir), "progress")), 300, "training to start")
        ctl = json.loads((run_dir / "control.json").read_text())
        store = TCPStore(ctl["host"], int(ctl["port"]), is_master=False, timeout=timedelta(seconds=10))
        now = time.time

        def enqueue(name: str, body) -> None:  # what any user of the node can do: reserve a slot, write it
            n = store.add(f"{name}/n", 1)
            store.set(f"{name}/{n}", body if isinstance(body, (str, bytes)) else json.dumps({"v": 1, "t": now(), **body}))

        agent_q, rank_q = protocol.q_agent("node1"), protocol.q_rank("node0", 0)
        # a crash command in an agent's queue and in a rank's queue (unsigned; with a made-up MAC)
        _forge_until_refused(store, run_dir, ("unsigned", agent_q), lambda: enqueue(agent_q, {"type": "inject", "mode": "rank", "slot": 0}))
        _forge_until_refused(store, run_dir, ("forged", rank_q), lambda: enqueue(
            rank_q, "phx1:%d:%s:%s" % (store.add(f"{rank_q}/n", 0), "0" * 64, json.dumps({"type": "fault", "mode": "crash"}))))
        # the generation bumped; heartbeats and a report forged
        genuine_gen = store.get(protocol.K_GEN)
        _forge_until_refused(store, run_dir, ("unsigned", protocol.K_GEN), lambda: store.set(protocol.K_GEN, "7"))
        store.set(protocol.K_GEN, genuine_gen)  # the genuine value back (the same sequence number: accepted)
        # (the ranks' own heartbeats are in their agent's node-local store: tests/test_node_digest.py forges those)
        hb = protocol.k_node_digest("node1")
        _forge_until_refused(store, run_dir, ("unsigned", hb), lambda: store.set(hb, json.dumps(
            {"node": "node1", "t": 0, "beats": {"0": {"t": 0, "step": 10**6, "phase": "training", "t_step": 0}}})))
        ahb = protocol.k_agent_hb("node1")
        _forge_until_refused(store, run_dir, ("unsigned", ahb), lambda: store.set(ahb, "0"))
        _forge_until_refused(store, run_dir, ("unsigned", protocol.Q_SUPERVISOR), lambda: enqueue(
            protocol.Q_SUPERVISOR, {"type": "rank_exit", "node": "node0", "slot": 0, "exit_code": 1, "error": {"type": "X", "message": "forged"}}))
        # a spare's assignment whose env would write a file anywhere
        assign = protocol.k_assign("node2", 0)
        _forge_until_refused(store, run_dir, ("unsigned", assign), lambda: store.set(assign, json.dumps(
            {"rank": 0, "gen": 1, "env": {"TORCHELASTIC_ERROR_FILE": str(tmp_path / "pwned")}})))
        store.delete_key(assign)
        # replays: a node's genuine digest written back once it is stale; a genuine report into a new slot
        old_hb = store.get(protocol.k_node_digest("node0"))
        old_step = max(hb.step for hb in protocol.NodeDigest.from_json(old_hb.decode().split(":", 3)[3]).beats.values())

        def supervisor_saw_newer() -> bool:  # it accepted a newer heartbeat of node0's ranks: the old one is a replay
            try:
                status = json.loads((run_dir / "status.json").read_text())
            except (OSError, ValueError):  # being replaced
                return False
            return any(n["name"] == "node0" and (n.get("step") or -1) > old_step for n in status["nodes"])
        wait_for(supervisor_saw_newer, 60, "the supervisor to read a newer heartbeat of rank 0", interval=0.1)
        _forge_until_refused(store, run_dir, ("replayed", protocol.k_node_digest("node0")), lambda: store.set(protocol.k_node_digest("node0"), old_hb))
        captured = _capture_queue_message(store, protocol.Q_SUPERVISOR)
        assert captured.startswith(b"phx1:")  # genuine messages are sealed
        _forge_until_refused(store, run_dir, ("replayed", protocol.Q_SUPERVISOR), lambda: enqueue(protocol.Q_SUPERVISOR, captured))
        hold.unlink()
        out, err = proc.communicate(timeout=400)
    finally:
        kill_job(proc, run_dir)
    assert proc.returncode == 0, err[-3000:]
    evs = events(run_dir)
    assert not of_type(evs, "recovery") and not of_type(evs, "failure") and not of_type(evs, "injected"), [e["type"] for e in evs]
    assert not (tmp_path / "pwned").exists()
    assert_same_digest(digest, expected)
    forged_keys = {agent_q, rank_q, protocol.K_GEN, hb, ahb, protocol.Q_SUPERVISOR, assign, protocol.k_node_digest("node0")}
    assert {k for _, k in _refused(run_dir)} <= forged_keys, sorted(_refused(run_dir))  # nothing genuine refused
    secret = (run_dir / "secret").read_text().strip()
    for p in [run_dir / "events.jsonl", run_dir / "status.json", *run_dir.glob("logs/*/*.log")]:
        assert secret not in p.read_text(errors="replace"), p
    assert not job_processes(run_dir)
    print(f"refused events: {len(of_type(evs, 'refused'))}; kinds: {sorted(_refused(run_dir))}")


@pytest.mark.timeout(30)
def test_an_envelope_is_checked_before_unpickling_and_a_checkpoint_outlives_the_secret(secret):
    from phoenix_runtime import state

    blob = state._b64({"a": 1})
    assert state._unb64(blob) == {"a": 1}
    evil = blob.split(":", 3)
    with pytest.raises(ValueError, match="refused: forged"):
        state._unb64(":".join(evil[:3] + [state.base64.b64encode(state.pickle.dumps(["x"])).decode()]))
    with pytest.raises(ValueError, match="refused: unsigned"):
        state._unb64(evil[3])
    meta = {"step": 3, "rng": blob, "loop": state._b64({"groups": None}), "shard": "0"}
    at_rest = state.meta_at_rest(meta)  # a persistent checkpoint: a later job (another secret) resumes from it
    auth.set_key(b"n" * 32)
    back = state.meta_from_rest(at_rest)
    assert state._unb64(back["rng"]) == {"a": 1} and back["step"] == 3 and back["shard"] == "0"
