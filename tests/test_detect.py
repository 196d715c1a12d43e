"""Issue 5: detection, classification and injection against running jobs (real processes and signals)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import EXAMPLES, SCRIPTS, events, job_env, job_processes, kill_job, of_type, phoenix_cmd, run_phoenix, start_phoenix, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
GPT = str(EXAMPLES / "train_gpt.py")
HB, HANG = 0.2, 4.0  # a hang timeout above the node timeout (as in the defaults, 10 s > 5 s)


def kill_node(run_dir: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(phoenix_cmd("kill-node", *args, "--run-dir", str(run_dir)), capture_output=True, text=True, timeout=60, cwd=cwd)


def recovered(run_dir: Path, n: int) -> bool:
    return len(of_type(events(run_dir), "recovery")) >= n


def decision_after(run_dir: Path, t: float) -> dict | None:
    ds = [e for e in of_type(events(run_dir), "decision") if e["t"] >= t]
    return ds[0] if ds else None


@pytest.fixture(scope="module")
def long_job(tmp_path_factory):
    d = tmp_path_factory.mktemp("detect")
    cfg = {"detect": {"heartbeat_s": HB, "hang_timeout_s": HANG, "node_timeout_s": 3.0, "recovery_timeout_s": 90}}
    (d / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    run_dir = d / "run"
    proc = start_phoenix(
        ["--config", str(d / "cfg.yaml"), "--nodes", "2", "--nproc-per-node", "1", "--spares", "5", "--run-dir", str(run_dir),
         GPT, "--steps", "100000", "--step-sleep", "0.05"], d,
    )
    try:
        wait_for(lambda: any(e.get("step", 0) >= 3 for e in of_type(events(run_dir), "progress")), 480, "training to start")
        yield run_dir, proc
    finally:
        kill_job(proc, run_dir)


def inject_and_expect(run_dir, n_before, target, mode, cls, decision):
    t = time.time()
    r = kill_node(run_dir, target, "--mode", mode)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("phoenix-run kill-node: ")
    wait_for(lambda: decision_after(run_dir, t), 60, f"a decision after {mode}")
    d = decision_after(run_dir, t)
    assert (d["cls"], d["decision"]) == (cls, decision), d
    wait_for(lambda: recovered(run_dir, n_before + 1), 90, f"recovery after {mode}")
    # latencies count from when the supervisor carried the command out (not from the CLI's start-up)
    return [e for e in of_type(events(run_dir), "injected") if e["t"] >= t][0]["t"]


def test_kill_node_modes_classes_and_actions(long_job, tmp_path):
    run_dir, proc = long_job
    # a command sealed with another secret (a copy of the run directory's control.json, a wrong secret) goes
    # through the store: refused as forged, unanswered, and the job is unharmed
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "control.json").write_text((run_dir / "control.json").read_text())
    (fake / "secret").write_text("11" * 32)
    r = kill_node(fake, "node1")
    assert r.returncode == 1 and "did not answer" in r.stderr, r.stderr
    wait_for(lambda: [e for e in of_type(events(run_dir), "refused") if e["kind"] == "forged" and e["key"] == "phx/q/cmd"], 10, "the refusal")
    assert "11" * 32 not in (run_dir / "events.jsonl").read_text() and not of_type(events(run_dir), "injected")
    # unknown targets: a clear message
    r = kill_node(run_dir, "node42")
    assert r.returncode == 2 and "no node 'node42'" in r.stderr
    r = kill_node(run_dir, "rank:99")
    assert r.returncode == 2 and "no rank 99" in r.stderr

    t = inject_and_expect(run_dir, 0, "node1", "crash", "host", "hotswap")
    lost = [e for e in of_type(events(run_dir), "failure") if e["t"] >= t][0]
    assert lost["kind"] == "node_lost" and lost["t"] - t < 1.0, "a crash is detected within 1 s"

    inject_and_expect(run_dir, 1, "rank:1", "rank", "host", "hotswap")

    t = inject_and_expect(run_dir, 2, "rank:1", "hang", "host", "hotswap")
    hang = [e for e in of_type(events(run_dir), "failure") if e["t"] >= t and e["kind"] == "hang"][0]
    assert hang["t"] - t <= HANG + HB + 1.0, "a hang is detected within its timeout plus one heartbeat (+ polling)"

    def spares_left():
        return json.loads((run_dir / "status.json").read_text())["spares_left"]

    spares_before = of_type(events(run_dir), "hotswap")[-1]["spares_left"]
    wait_for(lambda: spares_left() == spares_before, 30, "status.json to show the last hot-swap")
    t = inject_and_expect(run_dir, 3, "rank:0", "comm", "transient_comm", "local")
    assert not [e for e in of_type(events(run_dir), "hotswap") if e["t"] >= t], "no spare consumed"
    assert spares_left() == spares_before

    inject_and_expect(run_dir, 4, "rank:1", "gpu-ecc", "gpu_memory", "hotswap")
    inject_and_expect(run_dir, 5, "rank:0", "pcie", "host", "hotswap")
    assert proc.poll() is None, "the job is still running"


def test_software_bug_stops_after_one_attempt_with_its_traceback(tmp_path, run_dir):
    r = run_phoenix(["--nodes", "2", "--nproc-per-node", "1", "--spares", "1", "--max-restarts", "3", "--run-dir", str(run_dir),
                     GPT, "--steps", "10", "--bug-at-step", "3"], tmp_path)
    assert r.returncode == 1
    own = "\n".join(line for line in r.stderr.splitlines() if not line.startswith("[node"))  # not the ranks' own (issue 48)
    assert "ValueError: loss went NaN at step 3" in own
    assert own.count("Traceback (most recent call last)") == 1
    evs = events(run_dir)
    assert not of_type(evs, "restart") and not of_type(evs, "hotswap")
    assert of_type(evs, "decision")[0]["cls"] == "software"
    assert not job_processes(run_dir)


def test_kill_node_without_a_running_job(tmp_path):
    r = subprocess.run(phoenix_cmd("kill-node", "node1"), capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 1 and "no PHOENIX run directory" in r.stderr
    # a run directory whose job has ended
    d = tmp_path / "old"
    d.mkdir()
    (d / "control.json").write_text(json.dumps({"host": "127.0.0.1", "port": 1, "pid": 1}))
    (d / "secret").write_text("00" * 32)
    r = kill_node(d, "node1")
    assert r.returncode == 1 and "no running job" in r.stderr


def test_timeouts_are_checked_for_a_sane_order(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("detect:\n  heartbeat_s: 5\n  hang_timeout_s: 2\n")
    r = run_phoenix(["--config", str(cfg), GPT], tmp_path, timeout=60)
    assert r.returncode == 2 and "heartbeat_s < hang_timeout_s < collective_timeout_s" in r.stderr


def test_an_injected_fault_with_no_effect_closes_without_stopping_the_job(tmp_path, run_dir):
    """`comm` on a script without the runtime: nothing in the rank acts on it, so no failure is ever observed.
    The incident waits for the slowest detector (max(node, hang timeout) + 2 heartbeats), is closed, and the
    job runs on to success (it used to be stopped 'with no evidence')."""
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump({"detect": {"heartbeat_s": 0.2, "hang_timeout_s": 1.0, "node_timeout_s": 2.0}}))
    proc = start_phoenix(["--config", str(tmp_path / "cfg.yaml"), "--nodes", "2", "--nproc-per-node", "1", "--run-dir", str(run_dir),
                          str(SCRIPTS / "allreduce.py"), str(out)], tmp_path, env=job_env(RELEASE=str(tmp_path / "release")))
    try:
        wait_for(lambda: len(list(out.iterdir())) == 2, 180, "both ranks to be in the script")
        t = time.time()
        r = kill_node(run_dir, "rank:0", "--mode", "comm")
        assert r.returncode == 0, r.stderr
        closed = wait_for(lambda: [e for e in of_type(events(run_dir), "incident_closed") if e["t"] >= t], 60, "the incident to close")
        assert closed[0]["injected"] == "comm" and "no effect observed within 2.4 s" in closed[0]["why"]
        (tmp_path / "release").touch()  # the job ends once the incident was judged, however slow the machine
        assert proc.wait(timeout=120) == 0, proc.stderr.read()
    finally:
        kill_job(proc, run_dir)
    evs = events(run_dir)
    assert not of_type(evs, "decision") and not of_type(evs, "restart") and not of_type(evs, "failure")


STEPS_2X2 = ["--steps", "12"]  # ZeRO (replicated Adam joiners are the runtime's issue-12 RNG case)


@pytest.fixture(scope="module")
def clean_2x2_digest(tmp_path_factory):
    d = tmp_path_factory.mktemp("clean2x2")
    out = d / "clean.json"
    r = run_phoenix(["--nodes", "2", "--nproc-per-node", "2", "--run-dir", str(d / "run"), GPT, *STEPS_2X2, "--digest-file", str(out)], d, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())["digest"]


def test_a_rank_that_exits_with_a_comm_message_is_respawned_and_the_job_completes(tmp_path, run_dir, clean_2x2_digest):
    """Issue 12: a rank on a healthy node exits with 'Connection reset by peer' in its message. A process that
    exited is never transient: the decision is a local recovery that respawns it (a joiner of the new
    generation, restored from its peers), no spare is used, and the job completes with the failure-free digest."""
    out = tmp_path / "digest.json"
    env = job_env(EXIT_RANK="3", EXIT_AT_STEP="6", EXIT_MESSAGE="[gloo/transport/tcp/pair.cc:598] Connection reset by peer")
    r = run_phoenix(["--nodes", "2", "--nproc-per-node", "2", "--spares", "1", "--run-dir", str(run_dir),
                     str(SCRIPTS / "exit_at_step.py"), *STEPS_2X2, "--digest-file", str(out)], tmp_path, timeout=600, env=env)
    assert r.returncode == 0, r.stderr
    evs = events(run_dir)
    d = of_type(evs, "decision")[0]
    assert (d["cls"], d["decision"]) == ("process_exit", "local"), d
    local = of_type(evs, "local_recovery")[0]
    assert local["respawned"] == [3] and not of_type(evs, "hotswap")
    assert of_type(evs, "recovery")[0]["path"] == "local"
    assert (run_dir / "logs" / "node1" / "1.1.log").exists(), "the dead rank was started again (attempt 1)"
    assert json.loads(out.read_text())["digest"] == clean_2x2_digest


def test_a_rank_killed_before_the_first_step_replaces_its_node_and_starts_fresh(tmp_path, run_dir, clean_2x2_digest):
    """Issue 12: a rank SIGKILLed before anything is protected (here: before it even joined the control plane),
    a spare available: the node is replaced and every worker starts fresh (not counted as a restart); nothing is
    lost, so the job completes with the failure-free digest (it used to stop, exit 1)."""
    import psutil

    out = tmp_path / "digest.json"
    proc = start_phoenix(["--nodes", "2", "--nproc-per-node", "2", "--spares", "1", "--run-dir", str(run_dir), GPT, *STEPS_2X2,
                          "--digest-file", str(out)], tmp_path)
    try:
        def victim():
            for p in psutil.Process(proc.pid).children(recursive=True):
                try:
                    env = p.environ()
                except psutil.Error:
                    continue
                if env.get("PHOENIX_NODE") == "node1" and env.get("PHOENIX_SLOT") == "0" and env.get("PHOENIX_ATTEMPT") == "0":
                    return p
            return None
        wait_for(victim, 120, "node1's first rank to start").kill()  # at once: long before its first step
        assert proc.wait(timeout=600) == 0, proc.stderr.read()
    finally:
        kill_job(proc, run_dir)
    evs = events(run_dir)
    d = of_type(evs, "decision")[0]
    assert (d["decision"], d["node"], d["spare"]) == ("restart", "node1", "node2"), d
    restart = of_type(evs, "restart")[0]
    assert restart["fresh"] is True and restart["attempt"] == 0
    assert json.loads(out.read_text())["digest"] == clean_2x2_digest
