"""Issue 17: Prometheus metrics scraped from a running job, the live view's progress bar and last incident,
and ``kill-node`` answering at once (the run directory's command socket; no torch import on that path)."""

from __future__ import annotations

import io
import json
import os
import re
import resource
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from conftest import EXAMPLES, events, job_processes, kill_job, of_type, phoenix_cmd, run_phoenix, start_phoenix, wait_for
from phoenix_launch.plane.command_socket import SOCKET_NAME, CommandSocket, JobUnreachable, send
from phoenix_launch.observe.metrics import render_metrics
from phoenix_launch.observe.observe import JobCounters, progress_text, progress_view

GPT = str(EXAMPLES / "train_gpt.py")
FAST_S = 0.5  # the target for kill-node


# --- a small parser of the Prometheus text format (0.0.4) --------------------------------------------
NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
SAMPLE = re.compile(rf"^({NAME})(?:\{{(.*)\}})? (\S+)(?: -?\d+)?$")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"')


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """name -> [(labels, value)]; raises AssertionError on anything the format does not allow."""
    types: dict[str, str] = {}
    helps: set[str] = set()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    assert text.endswith("\n"), "the exposition ends with a newline"
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("# HELP "):
            name = line.split(" ", 3)[2]
            assert name not in helps, f"HELP twice for {name}"
            helps.add(name)
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            assert kind in ("counter", "gauge", "summary", "histogram", "untyped"), line
            assert name not in types, f"TYPE twice for {name}"
            assert name not in samples, f"TYPE after samples of {name}"
            types[name] = kind
            continue
        if line.startswith("#"):
            continue
        m = SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        name, body, value = m.groups()
        labels: dict[str, str] = {}
        if body:
            pos = 0
            while pos < len(body):
                lm = LABEL.match(body, pos)
                assert lm, f"bad labels in {line!r}"
                labels[lm.group(1)] = lm.group(2).replace("\\n", "\n").replace('\\"', '"').replace("\\\\", "\\")
                pos = lm.end()
                if pos < len(body):
                    assert body[pos] == ",", f"bad labels in {line!r}"
                    pos += 1
        family = re.sub(r"_(sum|count|bucket)$", "", name) if re.sub(r"_(sum|count|bucket)$", "", name) in types else name
        assert family in types, f"sample {name} has no TYPE line before it"
        samples.setdefault(name, []).append((labels, float(value)))
    return samples


def value(samples, name: str, **labels: str) -> float:
    found = [v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items())]
    assert len(found) == 1, f"{name}{labels}: {found} in {sorted(samples)}"
    return found[0]


# --- pure parts ------------------------------------------------------------------------------------------
def snapshot(**over):
    snap = {"run_id": 'job "a"\\b\nc', "state": "running", "gen": 2, "world_size": 2, "restarts": 0, "step": 40, "steps_per_s": 2.0,
            "spares_left": 1, "events": [], "nodes": [{"name": "node0", "state": "active", "ranks": [0], "step": 40, "failures": 0},
                                                      {"name": "node1", "state": "failed", "ranks": [], "step": None, "failures": 1},
                                                      {"name": "node2", "state": "active", "ranks": [1], "step": 40, "failures": 0}]}
    return {**snap, **over}


def fed(*evs):
    from phoenix_launch.observe.event_types import decode

    c = JobCounters()
    for e in evs:
        c.feed(decode(e))  # as events.jsonl's lines are read: typed
    return c


INCIDENT = [
    {"type": "progress", "t": 100.0, "step": 40, "step_time_s": 0.5, "sps": 2.0, "total": 100},
    {"type": "failure", "kind": "node_lost", "node": "node1"},
    {"type": "decision", "t": 101.0, "cls": "host", "decision": "hotswap", "node": "node1", "spare": "node2", "reason": "node lost"},
    {"type": "recovery", "path": "hotswap", "detect_s": 0.25, "recovered_s": 1.5, "total_s": 2.5, "resume_step": 38},
]


def test_metrics_text_is_valid_exposition_with_escaped_labels():
    samples = parse_prometheus(render_metrics(snapshot(), fed(*INCIDENT)))
    rid = 'job "a"\\b\nc'
    assert value(samples, "phoenix_job_state", state="running", run_id=rid) == 1
    assert value(samples, "phoenix_job_state", state="failed") == 0
    assert value(samples, "phoenix_generation") == 2
    assert value(samples, "phoenix_nodes", state="active") == 2 and value(samples, "phoenix_nodes", state="failed") == 1
    assert value(samples, "phoenix_spares_left") == 1
    assert value(samples, "phoenix_step") == 40 and value(samples, "phoenix_planned_steps") == 100
    assert value(samples, "phoenix_steps_per_second") == 2.0 and value(samples, "phoenix_step_time_seconds") == 0.5
    assert value(samples, "phoenix_failures_total", kind="node_lost") == 1
    assert value(samples, "phoenix_incidents_total", **{"class": "host", "decision": "hotswap"}) == 1
    assert value(samples, "phoenix_recoveries_total", **{"class": "host", "path": "hotswap"}) == 1
    assert value(samples, "phoenix_detection_seconds_count") == 1 and value(samples, "phoenix_detection_seconds_sum") == 0.25
    assert value(samples, "phoenix_last_recovery_seconds") == 1.5
    # nothing known yet: no made-up values (no NaN, no last durations)
    empty = parse_prometheus(render_metrics(snapshot(step=-1), JobCounters()))
    assert "phoenix_last_detection_seconds" not in empty and "phoenix_planned_steps" not in empty
    assert value(empty, "phoenix_recovery_seconds_count") == 0
    # every failure kind is a series from the start (at 0), so that rate() and alerts work before the first one
    assert value(empty, "phoenix_failures_total", kind="node_lost") == 0 and value(empty, "phoenix_failures_total", kind="hang") == 0
    assert "phoenix_eta_seconds" not in empty  # no total, no rate: no ETA
    snap = snapshot()
    snap["progress"] = progress_view(snap, fed(*INCIDENT))
    assert value(parse_prometheus(render_metrics(snap, fed(*INCIDENT))), "phoenix_eta_seconds") == 30.0
    # a shrinkable layout: the DP size now and the job's own (issue 31: dp 2 of 3 while shrunk); else neither
    shrunk = parse_prometheus(render_metrics(snapshot(dp=2, dp_full=3), JobCounters()))
    assert value(shrunk, "phoenix_dp_size") == 2 and value(shrunk, "phoenix_dp_full") == 3
    assert "phoenix_dp_size" not in empty


def test_progress_bar_eta_and_last_incident_in_the_live_view():
    from phoenix_launch.observe.ui import print_status

    snap = snapshot(run_id="r1")
    snap["progress"] = progress_view(snap, fed(*INCIDENT))
    assert snap["progress"]["total"] == 100 and snap["progress"]["eta_s"] == 30.0  # 60 steps left at 2 steps/s
    assert progress_text(snap["progress"]) == "step 40/100 (40%)  ETA 30s"
    assert "node1, host failure: replaced by spare node2, recovered in 1.50 s (resumed at step 38)" in snap["progress"]["last_incident"]
    out = io.StringIO()
    print_status(snap, out)
    text = out.getvalue()
    assert [line for line in text.splitlines() if "━" in line and line.rstrip().endswith("step 40/100 (40%)  ETA 30s")], text
    assert "last incident:" in text and "replaced by spare node2" in text
    # no total reported (a script without the runtime's loop): no bar, no ETA
    snap["progress"] = progress_view(snap, fed({"type": "progress", "step": 40, "sps": 2.0}))
    assert snap["progress"]["total"] is None and snap["progress"]["eta_s"] is None
    out = io.StringIO()
    print_status(snap, out)
    bars = [line for line in out.getvalue().splitlines() if "━" in line and not line.startswith(("┏", "┡"))]  # not the table's
    assert not bars and "ETA" not in out.getvalue()


class EchoHandler:
    """Stands in for the supervisor's CommandHandler: replies through the store it was given."""

    def __init__(self, replies):
        self.replies = replies
        self.seen = []

    def handle(self, raw, now):
        self.seen.append(raw)
        self.replies.set(f"phx/reply/{raw.get('id')}", json.dumps({"ok": True, "message": f"did {raw.get('target')}"}))


def test_command_socket_round_trip_mode_and_stale_socket(tmp_path):
    cs = CommandSocket(tmp_path)
    handlers = []
    assert cs.open(lambda replies: handlers.append(EchoHandler(replies)) or handlers[-1])
    stop = threading.Event()
    loop = threading.Thread(target=lambda: [cs.serve(time.time()) or time.sleep(0.01) for _ in iter(lambda: stop.is_set(), True)])
    loop.start()
    try:
        path = tmp_path / SOCKET_NAME
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        ctl = {"host": "127.0.0.1", "port": 1, "pid": os.getpid(), "node": os.uname().nodename}
        reply = send(tmp_path, ctl, {"type": "kill", "target": "node1", "id": "abc"}, 5.0)
        assert reply == {"ok": True, "message": "did node1"} and handlers[0].seen[0]["target"] == "node1"
        with socket.socket(socket.AF_UNIX) as raw:  # not a JSON line: refused, the server goes on
            raw.connect(str(path))
            raw.sendall(b"garbage\n")
            assert b"refused" in raw.recv(4096)
        assert send(tmp_path, ctl, {"type": "kill", "target": "node2"}, 5.0)["ok"]
    finally:
        stop.set()
        loop.join(5)
        cs.close()
    assert not (tmp_path / SOCKET_NAME).exists(), "the socket is removed when the job ends"
    # a supervisor that was SIGKILLed leaves its socket behind: refused, one clear error
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(tmp_path / SOCKET_NAME))
    stale.close()
    with pytest.raises(JobUnreachable, match="nothing listens on its command socket"):
        send(tmp_path, {"host": "127.0.0.1", "port": 1, "pid": os.getpid(), "node": os.uname().nodename}, {"type": "kill"}, 5.0)
    # on another host: not for the socket (the store path is used)
    assert send(tmp_path, {"host": "10.0.0.9", "port": 1, "pid": 1, "node": "elsewhere"}, {"type": "kill"}, 5.0) is None


# --- timing kill-node ------------------------------------------------------------------------------------
def timed(cmd: list[str], cwd: Path | None = None) -> tuple[subprocess.CompletedProcess, float, float]:
    """(result, wall seconds, CPU seconds of the child)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=cwd)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r, wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def assert_fast(cmd: list[str], what: str, check=lambda r: None, tries: int = 3) -> None:
    """``cmd`` answers in under 0.5 s. Its CPU time (torch's import alone is ~2 s of it) always; its wall
    time too, except on a machine so loaded (load average above its cores; this one is shared) that a bare
    interpreter's start is itself slow: then within 6 bare starts, measured interleaved (an idle start takes
    ~0.1 s here, the command's CPU ~0.2 s; the torch path took 20+). Best of ``tries``; ``check`` asserts on each."""
    walls, cpus, bares = [], [], []
    for _ in range(tries):
        bares.append(timed([sys.executable, "-c", "pass"])[1])
        r, wall, cpu = timed(cmd)
        check(r)
        walls.append(wall)
        cpus.append(cpu)
    wall, cpu, bare = min(walls), max(cpus), min(bares)
    loaded = os.getloadavg()[0] > (os.cpu_count() or 1)
    limit = max(FAST_S, 6 * bare) if loaded else FAST_S
    print(f"{what}: wall best {wall:.3f} s (all: {', '.join(f'{w:.2f}' for w in walls)}), CPU max {cpu:.3f} s; "
          f"bare interpreter {bare:.3f} s, load {os.getloadavg()[0]:.1f}, wall limit {limit:.2f} s")
    assert cpu < FAST_S, f"{what}: {cpu:.2f} s of CPU (torch imported?)"
    assert wall < limit, f"{what}: {wall:.2f} s (a bare interpreter: {bare:.2f} s)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_node_cmd(run_dir: Path, *args: str) -> list[str]:
    return phoenix_cmd("kill-node", *args, "--run-dir", str(run_dir))


def test_kill_node_on_a_stopped_job_is_one_line_at_once(tmp_path):
    rd = tmp_path / "run"
    rd.mkdir()
    (rd / "secret").write_text("00" * 32)
    port = free_port()  # nothing listens there
    (rd / "control.json").write_text(json.dumps({"host": "127.0.0.1", "port": port, "pid": os.getpid(), "node": os.uname().nodename}))

    def one_line(expect: str):
        def check(r):
            assert r.returncode == 1 and r.stdout == "", r
            assert r.stderr.count("\n") == 1 and r.stderr.startswith("phoenix-run: error: ") and expect in r.stderr, r.stderr
        return check

    # an ended job: its socket removed, its store's port closed
    assert_fast(kill_node_cmd(rd, "node1"), "kill-node, ended job", one_line(f"no running job at 127.0.0.1:{port}"))
    # a supervisor that was SIGKILLed left its socket behind: refused, one line
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(rd / SOCKET_NAME))
    stale.close()
    assert_fast(kill_node_cmd(rd, "node1"), "kill-node, SIGKILLed supervisor", one_line("nothing listens on its command socket"))


# --- a real job: metrics scraped while it runs, kill-node timed, the end --------------------------------
def scrape(url: str):
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            return parse_prometheus(resp.read().decode())
    except OSError:
        return None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_job_serves_metrics_shows_progress_and_takes_kill_node_at_once(tmp_path, run_dir):
    port = free_port()
    prom = tmp_path / "phoenix.prom"
    cfg = {"detect": {"heartbeat_s": 0.2, "hang_timeout_s": 4.0, "node_timeout_s": 3.0, "recovery_timeout_s": 120},
           "metrics": {"textfile": str(prom)}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    steps = 100000
    proc = start_phoenix(["--config", str(tmp_path / "cfg.yaml"), "--metrics-port", str(port), "--nodes", "2", "--nproc-per-node", "1",
                          "--spares", "1", "--run-dir", str(run_dir), GPT, "--steps", str(steps), "--step-sleep", "0.05"], tmp_path)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        announced = wait_for(lambda: of_type(events(run_dir), "metrics"), 120, "the metrics event")
        assert announced[0]["url"] == url
        # scraped during the run: training is visible
        samples = wait_for(lambda: (s := scrape(url)) and s.get("phoenix_step", [({}, -1)])[0][1] >= 3 and s, 480, "phoenix_step >= 3")
        assert value(samples, "phoenix_job_state", state="running") == 1
        assert value(samples, "phoenix_nodes", state="active") == 2 and value(samples, "phoenix_spares_left") == 1
        assert value(samples, "phoenix_world_size") == 2 and value(samples, "phoenix_generation") == 0
        samples = wait_for(lambda: (s := scrape(url)) and "phoenix_planned_steps" in s and s, 60, "the loop's total in the metrics")
        assert value(samples, "phoenix_planned_steps") == steps and value(samples, "phoenix_steps_per_second") > 0
        status = json.loads((run_dir / "status.json").read_text())
        assert status["progress"]["total"] == steps and status["progress"]["eta_s"] > 0
        textfile = wait_for(lambda: prom.exists() and parse_prometheus(prom.read_text()), 30, "the textfile")
        assert value(textfile, "phoenix_job_state", state="running") == 1

        # kill-node on a live job: answered at once (the command socket), and carried out
        ctl = json.loads((run_dir / "control.json").read_text())
        answers = []
        for i in range(3):  # the supervisor's side: a command answered within a few of its 20 ms ticks
            t0 = time.perf_counter()
            reply = send(run_dir, ctl, {"type": "kill", "target": "node9", "token": "wrong", "id": f"t{i}"}, 5.0)
            answers.append(time.perf_counter() - t0)
            assert reply == {"ok": False, "error": "refused: the job's token does not match"}, reply
        print(f"supervisor's answer over the socket: {', '.join(f'{a * 1000:.0f} ms' for a in answers)}")
        assert min(answers) < 0.2

        def no_such_node(r):  # delivered, run through the handler, answered
            assert r.returncode == 2 and r.stderr.strip() == "phoenix-run: error: no node 'node9' in this job; nodes: node0, node1, node2", r
        assert_fast(kill_node_cmd(run_dir, "node9"), "kill-node, live job", no_such_node)
        r, wall, cpu = timed(kill_node_cmd(run_dir, "node1"))
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == "phoenix-run kill-node: SIGKILLed node node1 (its agent and 1 rank(s))" and r.stderr == ""
        print(f"kill-node node1 on the live job: wall {wall:.3f} s, CPU {cpu:.3f} s")
        assert cpu < FAST_S

        # the recovery in the metrics and the live view's last incident
        samples = wait_for(lambda: (s := scrape(url)) and "phoenix_recoveries_total" in s and s.get("phoenix_recoveries_total")
                           and s, 240, "the recovery in the metrics")
        assert value(samples, "phoenix_recoveries_total", **{"class": "host", "path": "hotswap"}) == 1
        assert value(samples, "phoenix_incidents_total", **{"class": "host", "decision": "hotswap"}) == 1
        assert value(samples, "phoenix_detection_seconds_count") == 1 and 0 <= value(samples, "phoenix_last_detection_seconds") < 5
        assert value(samples, "phoenix_last_recovery_seconds") > 0
        assert value(samples, "phoenix_spares_left") == 0 and value(samples, "phoenix_nodes", state="active") == 2
        assert value(samples, "phoenix_nodes", state="failed") + value(samples, "phoenix_nodes", state="drained") == 1
        assert value(samples, "phoenix_generation") == 1
        wait_for(lambda: "replaced by spare node2" in json.loads((run_dir / "status.json").read_text())["progress"]["last_incident"], 30,
                 "the last incident in status.json")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        kill_job(proc, run_dir)
    # the end: the textfile keeps the final state; the metrics server and the socket are gone
    final = parse_prometheus(prom.read_text())
    assert value(final, "phoenix_job_state", state="failed") == 1 and value(final, "phoenix_job_state", state="running") == 0
    assert scrape(url) is None and not (run_dir / SOCKET_NAME).exists()

    def ended(r):
        assert r.returncode == 1 and r.stderr.count("\n") == 1 and "no running job" in r.stderr, r.stderr
    assert_fast(kill_node_cmd(run_dir, "node0"), "kill-node, ended job", ended)
    assert not job_processes(run_dir)


def test_metrics_port_out_of_range_is_one_line(tmp_path):
    r = run_phoenix(["--metrics-port", "70000", GPT], tmp_path, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == "phoenix-run: error: --metrics-port must be in 0..65535 (0: off), got 70000"
