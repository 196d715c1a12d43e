"""Issue 16, section 1: the job survives the loss of its supervisor (``launch.standby: on``, local backend).

Real processes: ``phoenix-run`` (the leader) is SIGKILLed mid-run; the standby supervisor (a process of its
own) takes the job over, agents and ranks reconnect to its store, and the job ends with the failure-free
digest. The outcome is read from the run directory (the process the test started is the one that was lost).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import (EXAMPLES, assert_same_digest, events, job_processes, kill_job, load_digest, of_type, phoenix_cmd,
                      run_phoenix, start_phoenix, stop_fully, wait_for)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

GPT = str(EXAMPLES / "train_gpt.py")
STEPS = 24


def _write_cfg(d: Path, standby: bool) -> Path:
    cfg = {"launch": {"standby": "on" if standby else "off"}, "detect": {"recovery_timeout_s": 90}}
    (d / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    return d / "cfg.yaml"


def _args(d: Path, cfg: Path, sleep: float) -> list[str]:
    """``sleep`` seconds per step while ``d/slow`` exists: the job outlives what a test does to it."""
    return ["--config", str(cfg), "--nodes", "2", "--nproc-per-node", "2", "--spares", "1", "--run-dir", str(d / "run"),
            GPT, "--steps", str(STEPS), "--step-sleep", str(sleep), "--step-sleep-while", str(d / "slow"),
            "--digest-file", str(d / "digest.json")]


@pytest.fixture(autouse=True)
def _reap(tmp_path):
    """Whatever a failed test leaves of its job (the standby outlives the process the test started)."""
    yield
    for p in job_processes(tmp_path / "run"):
        try:
            p.kill()
        except Exception:  # noqa: BLE001 -- gone already
            pass


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """A failure-free run with the standby on: the digest to compare with, and a job that ends on purpose
    leaves no standby behind (the leader stops it)."""
    d = tmp_path_factory.mktemp("standby-base")
    r = run_phoenix(_args(d, _write_cfg(d, True), 0.0), d, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    evs = events(d / "run")
    assert not of_type(evs, "takeover"), "a job that ended on purpose was taken over"
    assert not job_processes(d / "run"), "the standby (or an agent) outlived the job"
    return load_digest(d / "digest.json", "failure-free run")


def _progress(run_dir: Path, step: int):
    return any(e["type"] == "progress" and e.get("step", -1) >= step for e in events(run_dir))


def _job_end(run_dir: Path):
    ends = of_type(events(run_dir), "job_end")
    return ends[-1] if ends else None


def _kill_leader_at(tmp_path: Path, step: int, and_node: str | None = None, standby_first: bool = False):
    """Start the job, SIGKILL phoenix-run (and the agent's process group of ``and_node``) once step ``step`` is done."""
    d = tmp_path
    run_dir = d / "run"
    (d / "slow").touch()
    proc = start_phoenix(_args(d, _write_cfg(d, True), 1.0), d)
    try:
        wait_for(lambda: _progress(run_dir, step) and of_type(events(run_dir), "standby_ready"), 180, f"step {step} and a ready standby")
        if standby_first:  # the standby itself is lost first: the leader replaces it
            (sb,) = [p for p in job_processes(run_dir) if "phoenix_launch.standby.standby" in " ".join(p.cmdline())]
            sb.kill()
            wait_for(lambda: of_type(events(run_dir), "standby_lost") and len(of_type(events(run_dir), "standby_ready")) == 2, 60,
                     "a new standby after the first was lost")
        standby = json.loads((run_dir / "standby.json").read_text())
        assert standby["address"].startswith("127.0.0.1:")
        victims = []
        if and_node is not None:
            spec = run_dir / "logs" / and_node / "agent.spec.json"
            victims = [p for p in job_processes(run_dir) if str(spec) in " ".join(p.cmdline())]
            assert victims, f"no agent of {and_node}"
        proc.send_signal(signal.SIGKILL)
        for v in victims:
            os.killpg(v.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        return proc, run_dir
    except BaseException:
        kill_job(proc, run_dir)
        raise


def _assert_completed(run_dir: Path, digest: Path, expected: dict, takeovers: int = 1) -> list[dict]:
    try:
        end = wait_for(lambda: _job_end(run_dir), 240, "the job's end after the takeover")
    except AssertionError:
        for p in job_processes(run_dir):
            p.kill()
        raise
    evs = events(run_dir)
    assert end["exit_code"] == 0, (end, [e["type"] for e in evs][-30:])
    ts = of_type(evs, "takeover")
    assert len(ts) == takeovers, ts
    assert all(t["was"] in ("running", "recovering") and t["serving_s"] >= 0 for t in ts), ts
    # status.json's final state follows job_end (the shutdown writes it last)
    wait_for(lambda: json.loads((run_dir / "status.json").read_text())["state"] == "succeeded", 30, "status.json: succeeded")
    ctl = json.loads((run_dir / "control.json").read_text())
    assert ctl["pid"] == ts[-1]["pid"] and ctl["incarnation"] == takeovers
    assert_same_digest(digest, expected)  # fails when the digest file is missing
    wait_for(lambda: not job_processes(run_dir), 30, "every process of the job to exit")
    return evs


def test_supervisor_sigkilled_twice_the_standby_takes_over_and_steers_the_job(tmp_path, baseline):
    """SIGKILL of phoenix-run at step 3: the standby serves the control plane, training goes on, and starts a
    standby of its own; that new leader is SIGKILLed too, and the second standby takes over. Then ``kill-node``
    (through the newest control.json) crashes node1 and the third leader hot-swaps the spare in."""
    _, run_dir = _kill_leader_at(tmp_path, 3)
    first = wait_for(lambda: of_type(events(run_dir), "takeover"), 60, "the first takeover")[0]
    wait_for(lambda: [e for e in of_type(events(run_dir), "standby_ready") if e["incarnation"] == 2], 60, "the new leader's standby")
    os.kill(first["pid"], signal.SIGKILL)
    wait_for(lambda: len(of_type(events(run_dir), "takeover")) == 2, 60, "the second takeover")
    r = subprocess.run(phoenix_cmd("kill-node", "node1", "--run-dir", str(run_dir)), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    wait_for(lambda: of_type(events(run_dir), "recovery"), 120, "the recovery after the hot-swap")
    (tmp_path / "slow").unlink()
    evs = _assert_completed(run_dir, tmp_path / "digest.json", baseline, takeovers=2)
    swaps = of_type(evs, "hotswap")
    assert [(s["failed"], s["spare"]) for s in swaps] == [("node1", "node2")]
    assert of_type(evs, "recovery"), "no recovery event after the hot-swap under the new leader"


def test_supervisor_and_a_node_lost_together(tmp_path, baseline):
    """The standby is SIGKILLed first (the leader starts another); then the supervisor and node0 (agent and
    ranks) are SIGKILLed at once: the new standby takes over and hot-swaps node0 onto the spare."""
    _, run_dir = _kill_leader_at(tmp_path, 3, and_node="node0", standby_first=True)
    wait_for(lambda: of_type(events(run_dir), "recovery"), 120, "the recovery after the hot-swap")
    (tmp_path / "slow").unlink()
    evs = _assert_completed(run_dir, tmp_path / "digest.json", baseline)
    assert [(s["failed"], s["spare"]) for s in of_type(evs, "hotswap")] == [("node0", "node2")]


def test_standby_setting_is_checked(tmp_path):
    """A bad launch.standby is one clear line and exit 2, before anything starts."""
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump({"launch": {"standby": "maybe"}}))
    r = run_phoenix(["--config", str(tmp_path / "cfg.yaml"), "--run-dir", str(tmp_path / "run"), GPT], tmp_path, timeout=120)
    assert r.returncode == 2 and "launch.standby must be auto, on or off" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_supervisor_lost_during_a_hot_swap(tmp_path, baseline):
    """node1 crashed (``kill-node``) and the leader SIGKILLed as soon as it published the hot-swap's generation:
    the standby holds that generation (mirrored before any rank could see it), forms it again under its own
    watch, and the recovery completes with the failure-free digest. (It failed intermittently, more under CPU load,
    while a rank could leave generation 1's rendezvous alone, on the re-formed generation's publication, and
    strand the peers waiting in gloo's connect for it until the 90 s recovery timeout: ``Context._commit``.)"""
    d = tmp_path
    run_dir = d / "run"
    (d / "slow").touch()
    proc = start_phoenix(_args(d, _write_cfg(d, True), 0.3), d)
    wait_for(lambda: _progress(run_dir, 3) and of_type(events(run_dir), "standby_ready"), 180, "step 3 and a ready standby")
    r = subprocess.run(phoenix_cmd("kill-node", "node1", "--run-dir", str(run_dir)), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    wait_for(lambda: of_type(events(run_dir), "hotswap"), 60, "the hot-swap's generation", interval=0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    wait_for(lambda: of_type(events(run_dir), "recovery"), 120, "the recovery under the new leader")
    (d / "slow").unlink()
    evs = _assert_completed(run_dir, d / "digest.json", baseline)
    (t,) = of_type(evs, "takeover")
    assert t["gen"] == 1, t  # the hot-swap's generation, mirrored before its bump
    assert [(s["failed"], s["spare"]) for s in of_type(evs, "hotswap")] == [("node1", "node2")]
    again = [e for e in of_type(evs, "reprotect") if e["gen"] == 2]
    assert again, "the takeover did not form the unsettled generation again"


@pytest.mark.timeout(60)
def test_a_read_that_follows_a_takeover_fails_at_once_where_the_new_store_lacks_its_keys(tmp_path):
    """A client's read made on the leader's store and retried on the new leader's after the move: the new store
    holds only what the new leader restored, and a read of a key it lacks would wait the store's whole timeout (an
    agent relaying the generation then sent no heartbeat for 30 s and the new leader declared its node lost). It
    fails at once instead (the caller reads again, knowing the store moved); a key the new store holds is read."""
    import sys
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from phoenix_runtime.plane import failover, protocol

    leader = subprocess.Popen([sys.executable, "-c", "import time, datetime, torch.distributed as d; "
                               "s = d.TCPStore('127.0.0.1', 0, is_master=True, timeout=datetime.timedelta(seconds=30)); "
                               "s.set('only-in-the-old', 'x'); print(s.port, flush=True); time.sleep(120)"],
                              stdout=subprocess.PIPE, text=True)
    new = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), use_libuv=True)
    try:
        port = int(leader.stdout.readline())
        (tmp_path / protocol.CONTROL_FILE).write_text(json.dumps({"host": "127.0.0.1", "port": port, "incarnation": 0}))
        client = failover.FailoverStore(("127.0.0.1", port), tmp_path, timeout_s=20.0, reconnect_s=20.0)
        assert client.get("only-in-the-old") == b"x"
        new.set("restored", "y")
        new.set(protocol.K_RESTORED, "1")
        (tmp_path / protocol.CONTROL_FILE).write_text(json.dumps({"host": "127.0.0.1", "port": new.port, "incarnation": 1}))
        leader.kill()
        leader.wait(timeout=10)
        t0 = time.monotonic()
        with pytest.raises(dist.DistNetworkError, match="moved to incarnation 1"):
            client.multi_get(["restored", "only-in-the-old"])
        assert time.monotonic() - t0 < 10 and client.incarnation == 1
        assert client.multi_get(["restored"]) == [b"y"]
    finally:
        leader.kill()
        leader.wait(timeout=10)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["vanished", "superseded"])
def test_a_store_call_on_a_lost_leader_is_cut_not_left_hanging(monkeypatch, how):
    """A leader whose host vanishes without a reset leaves store calls waiting in recv (torch's check and add
    have no deadline there). Stopped here with SIGSTOP (the call hangs) and its port said unreachable, the
    watchdog of ``failover.guarded`` cuts the connection: the call fails as on a closed one, within seconds.
    ``superseded``: the port still accepts connects (a stopped process's kernel does), but a newer leader
    serves the job: the call is cut as soon as it stalls, not after ``FROZEN_S`` (a standby that took over
    before this client's own call was cut judges its heartbeats from the takeover on)."""
    import sys
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from phoenix_runtime.plane import failover

    server = subprocess.Popen([sys.executable, "-c", "import sys, time, datetime, torch.distributed as d; "
                               "s = d.TCPStore('127.0.0.1', 0, is_master=True, timeout=datetime.timedelta(seconds=30)); "
                               "print(s.port, flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        addr = ("127.0.0.1", port)
        client = dist.TCPStore(*addr, is_master=False, timeout=timedelta(seconds=30))
        client.set("k", "v")
        monkeypatch.setattr(failover, "STALL_S", 0.5)
        if how == "vanished":
            monkeypatch.setattr(failover, "reachable", lambda a, *args, **kw: a != addr)
        stop_fully(server)  # the call below gets no answer, and no reset
        t0 = time.monotonic()
        with pytest.raises(dist.DistError):
            with failover.guarded(addr, (lambda: True) if how == "superseded" else None):
                client.check(["k"])
        assert time.monotonic() - t0 < 10 < failover.FROZEN_S
        assert not failover.frozen(addr)  # cut for what it was, not as a frozen leader
    finally:
        server.send_signal(signal.SIGCONT)
        server.kill()
        server.wait(timeout=10)


def test_a_hung_leader_ends_itself_and_the_standby_takes_over(tmp_path, baseline):
    """The leader's loop hangs at step 3 (``inject.leader_hang_at_step``) while its store server, a C++ thread,
    serves on: nothing outside can tell it from a healthy one. Its faulthandler watchdog ends it after
    ``detect.leader_hang_s`` with every thread's stack on stderr; the standby takes over and the job completes
    with the failure-free digest."""
    d = tmp_path
    cfg = yaml.safe_load(_write_cfg(d, True).read_text())
    cfg["detect"]["leader_hang_s"] = 3.0
    cfg["inject"] = {"leader_hang_at_step": 3}
    (d / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    (d / "slow").touch()
    proc = start_phoenix(_args(d, d / "cfg.yaml", 0.3), d)
    run_dir = d / "run"
    try:
        _, err = proc.communicate(timeout=180)
    except BaseException:
        kill_job(proc, run_dir)
        raise
    hung = [e for e in of_type(events(run_dir), "injected") if e.get("mode") == "leader_hang"]
    assert hung and proc.returncode == 1, (proc.returncode, err[-3000:])
    assert "Timeout (0:00:03)!" in err and "run_chaos" in err, err[-3000:]  # the stuck loop's stack, for the operator
    wait_for(lambda: of_type(events(run_dir), "takeover"), 60, "the takeover of the hung leader's job")
    (d / "slow").unlink()
    evs = _assert_completed(run_dir, d / "digest.json", baseline)
    assert not of_type(evs, "hotswap"), "a hung leader is not a lost node"


def test_a_stopped_leader_is_taken_over_and_leaves_when_it_wakes(tmp_path, baseline):
    """SIGSTOP of phoenix-run at step 3: its port still accepts connects (the kernel does) but nothing answers,
    so every store call to it is cut after ``failover.FROZEN_S``; the standby takes over (``how: frozen``) and
    agents and ranks move to it. SIGCONT: the old leader sees the newer incarnation and leaves (exit 75)
    without touching the job, which completes with the failure-free digest."""
    d = tmp_path
    run_dir = d / "run"
    (d / "slow").touch()
    proc = start_phoenix(_args(d, _write_cfg(d, True), 1.5), d)
    try:
        wait_for(lambda: _progress(run_dir, 3) and of_type(events(run_dir), "standby_ready"), 180, "step 3 and a ready standby")
        proc.send_signal(signal.SIGSTOP)
        took = wait_for(lambda: of_type(events(run_dir), "takeover"), 90, "the takeover of the stopped leader's job")
        assert took[0]["how"] == "frozen", took
        wait_for(lambda: of_type(events(run_dir), "takeover_complete"), 60, "every agent at the new leader")
        proc.send_signal(signal.SIGCONT)
        _, err = proc.communicate(timeout=60)
    except BaseException:
        proc.send_signal(signal.SIGCONT)
        kill_job(proc, run_dir)
        raise
    assert proc.returncode == 75 and "superseded by the standby" in err, (proc.returncode, err[-3000:])
    (d / "slow").unlink()
    evs = _assert_completed(run_dir, d / "digest.json", baseline)
    assert of_type(evs, "superseded") and not of_type(evs, "hotswap"), [e["type"] for e in evs]
