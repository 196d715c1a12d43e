"""The control plane at fleet scale: the real supervisor and its store, N simulated nodes x R ranks, no training.

    python bench/fleet.py [--nodes 10,100,1000,10000] [--ranks-per-node 8] [--workers 2] [--conns 4] [--quick]

Per N: one supervisor process (``fleet_sup.py``: phoenix_launch's ``Supervisor``, its loop and its TCPStore, the
store a thread of that process as in a real job) and ``--workers`` processes of simulated nodes (``fleet_sim.py``,
whose header says exactly what is real and what is modelled: every call a real agent or rank makes to the central
store is made, by the real code; the node-local part, the ranks' own heartbeats into their agent's store, is
modelled; ``--conns`` connections each plus two notify watchers, the ranks' counter, which the agents relay, and the
agents'). At 10,000 nodes run it with a longer heartbeat (``--heartbeat-s 2 --node-timeout-s 10``: the two
simulation processes carry 10,000 agents' heartbeats, each a real round trip, on two shared cores).
Once every node is up and every rank has reported ``RuntimeReady``:
a steady window (``--window-s``), then one node is lost (its agent and ranks stop at once), the supervisor's
``failure`` event and its ``decision`` (a hot-swap onto the one spare) are timed from the loss, and the
generation it publishes is timed until every live agent has read it from the central store ("agents s": the store's
and the supervisor's part) and until every live simulated rank has seen it (relayed by its agent: "gen seen s",
which adds the simulation's own work, every node's local part done on the simulation's two processes).

One row per N, then a growth law per quantity (least squares on log-log, with its data points) and where each
target breaks. Every row is measured on this machine; a crossing beyond the largest N run is extrapolated.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import fleet_fit
from common import med

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from phoenix_launch.detect.procs import die_with_parent  # noqa: E402


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def cpu_s(pid: int, tid: int | None = None) -> float:
    """User + system CPU seconds of a process (or one of its threads), from /proc."""
    p = f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"
    try:
        f = open(p).read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def store_connections(pid: int, port: int) -> int:
    """Established TCP connections the store server holds (its side of every client, the supervisor's own too)."""
    import psutil

    try:
        return sum(1 for c in psutil.Process(pid).net_connections("tcp") if c.laddr and c.laddr.port == port and c.status == "ESTABLISHED")
    except psutil.Error:
        return -1


class Job:
    """The supervisor and the simulation processes of one N; :meth:`close` leaves none behind (bounded)."""

    def __init__(self, a, n: int, run_dir: Path):
        self.a, self.n, self.run_dir = a, n, run_dir
        self.procs: list[subprocess.Popen] = []
        self.workers: list[tuple[int, int, subprocess.Popen]] = []
        log = open(run_dir / "sup.log", "wb")
        self.sup = self._spawn([sys.executable, str(HERE / "fleet_sup.py"), "--run-dir", str(run_dir), "--nodes", str(n),
                                "--nproc", str(a.ranks_per_node), "--spares", "1", "--heartbeat-s", str(a.heartbeat_s),
                                "--node-timeout-s", str(a.node_timeout_s)], log, subprocess.DEVNULL)
        self.port = self._wait(lambda: read_json(run_dir / "control.json").get("port"), 60, "the supervisor's control.json")
        self._wait(lambda: (run_dir / "secret").exists(), 10, "the job's secret")
        total = n + 1  # one spare
        k = max(1, min(a.workers, total))
        bounds = [total * i // k for i in range(k + 1)]
        for lo, hi in zip(bounds, bounds[1:]):
            wlog = open(run_dir / f"sim{lo}.log", "wb")
            p = self._spawn([sys.executable, str(HERE / "fleet_sim.py"), "--run-dir", str(run_dir), "--port", str(self.port),
                             "--nodes", f"{lo}:{hi}", "--active", str(n), "--nproc", str(a.ranks_per_node),
                             "--conns", str(a.conns), "--heartbeat-s", str(a.heartbeat_s)], wlog, subprocess.PIPE)
            self.workers.append((lo, hi, p))

    def _spawn(self, cmd, log, stdin) -> subprocess.Popen:
        p = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=stdin, cwd=HERE, preexec_fn=die_with_parent,
                             env={**os.environ, "OMP_NUM_THREADS": "1",  # the caller's path after the bench's (a worktree's shim)
                                  "PYTHONPATH": os.pathsep.join(p for p in (str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")) if p)})
        self.procs.append(p)
        return p

    def _wait(self, pred, timeout: float, what: str):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            v = pred()
            if v:
                return v
            if self.sup.poll() is not None:
                raise RuntimeError(f"the supervisor exited ({self.sup.returncode}) before {what}; see {self.run_dir}/sup.log")
            time.sleep(0.1)
        raise TimeoutError(what)

    def sup_stats(self) -> dict:
        return read_json(self.run_dir / "bench_sup.json")

    def sims(self) -> list[dict]:
        return [read_json(self.run_dir / f"bench_sim{lo}.json") for lo, _, _ in self.workers]

    def kill_node(self, index: int) -> None:
        for lo, hi, p in self.workers:
            if lo <= index < hi and p.stdin:
                p.stdin.write(f"kill node{index}\n".encode())
                p.stdin.flush()

    def close(self) -> None:
        for _, _, p in self.workers:
            try:
                p.stdin.close()  # type: ignore[union-attr]  (end of input: the worker exits)
            except (OSError, AttributeError):
                pass
        if self.sup.poll() is None:
            self.sup.send_signal(signal.SIGTERM)
        end = time.monotonic() + 20
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)


def events(run_dir: Path) -> list[dict]:
    try:
        return [json.loads(l) for l in (run_dir / "events.jsonl").read_text().splitlines() if l.strip()]
    except (OSError, ValueError):
        return []


def steady(job: Job, window_s: float) -> dict:
    """Loop period, round trips per second, CPU and RSS of the supervisor over a window of the running job."""
    pid = job.sup.pid
    s0, sims0 = job.sup_stats(), job.sims()
    c0, cl0, w0, t0 = cpu_s(pid), cpu_s(pid, pid), sum(cpu_s(p.pid) for _, _, p in job.workers), time.monotonic()
    time.sleep(window_s)
    s1, sims1 = job.sup_stats(), job.sims()
    c1, cl1, w1, t1 = cpu_s(pid), cpu_s(pid, pid), sum(cpu_s(p.pid) for _, _, p in job.workers), time.monotonic()
    dt = t1 - t0
    passes = [p for p in s1.get("passes", []) if p >= s1["passes"][-1] - window_s] if s1.get("passes") else []
    periods = sorted(b - a for a, b in zip(passes, passes[1:]))
    sim_ops = sum(x.get("ops", 0) for x in sims1) - sum(x.get("ops", 0) for x in sims0)
    sup_ops = s1.get("ops", 0) - s0.get("ops", 0)
    return {
        "period_med_ms": 1000 * med(periods) if periods else float("nan"),
        "period_p99_ms": 1000 * periods[int(len(periods) * 0.99)] if periods else float("nan"),
        "status_write_ms": 1000 * med(s1.get("status_writes", [])[-10:]), "hb_check_ms": 1000 * med(s1.get("hb_checks", [])[-10:]),
        "ops_s": (sim_ops + sup_ops) / dt, "sup_ops_s": sup_ops / dt,
        "cpu_proc": 100 * (c1 - c0) / dt, "cpu_loop": 100 * (cl1 - cl0) / dt, "cpu_sim": 100 * (w1 - w0) / dt,
        "rss_mb": rss_mb(pid), "conns": store_connections(pid, job.port),
        "sim_lag_p99_ms": 1000 * max((x.get("lag_p99", 0.0) for x in sims1), default=0.0),
        "load": os.getloadavg()[0],
    }


def incident(job: Job, a) -> dict:
    """Lose one node; time the failure event, the decision, the bump and the generation seen by every live rank."""
    victim = job.n // 2
    gen0 = int(job.sup_stats().get("gen", 0))
    t_loss = time.time()
    job.kill_node(victim)
    out: dict = {"detect_s": None, "decide_s": None, "propagate_s": None, "seen": 0, "live_ranks": 0}
    end = time.monotonic() + a.node_timeout_s + a.incident_timeout_s
    while time.monotonic() < end and out["decide_s"] is None:
        for ev in events(job.run_dir):
            if ev["t"] < t_loss:
                continue
            if ev["type"] == "failure" and ev.get("node") == f"node{victim}" and out["detect_s"] is None:
                out["detect_s"] = ev["t"] - t_loss
            if ev["type"] == "decision" and out["decide_s"] is None:
                out["decide_s"], out["decision"] = ev["t"] - t_loss, ev.get("decision")
        time.sleep(0.1)
    bump = None
    end = time.monotonic() + a.incident_timeout_s
    while time.monotonic() < end:
        bump = job.sup_stats().get("bumps", {}).get(str(gen0 + 1))
        sims = job.sims()
        live = sum(x.get("ranks", 0) for x in sims) - a.ranks_per_node
        seen = [x.get("seen", {}).get(str(gen0 + 1), {}) for x in sims]
        relayed = [x.get("relayed", {}).get(str(gen0 + 1), {}) for x in sims]
        out["seen"], out["live_ranks"] = sum(s.get("count", 0) for s in seen), live
        if bump and out["seen"] >= live:
            out["propagate_s"] = max(s["last"] for s in seen if s) - bump
            # each simulation process's median and 90th percentile: a ramp (the processes' CPU) or a tail (a lane behind)
            out["seen_quantiles"] = [(round(s["p50"] - bump, 3), round(s["p90"] - bump, 3)) for s in seen if s and "p50" in s]
            # every live agent (the nodes and the spare, less the one lost) read it centrally: the store's part
            if sum(r.get("count", 0) for r in relayed) >= job.n:
                out["relay_s"] = max(r["last"] for r in relayed if r) - bump
            break
        time.sleep(0.2)
    stats = job.sup_stats()
    out["members_kb"], out["members_diff_b"] = stats.get("members_bytes", 0) / 1024, stats.get("members_diff_bytes", 0)
    return out


def run_one(a, n: int) -> dict:
    keep = contextlib.nullcontext(tempfile.mkdtemp(prefix=f"fleet{n}-")) if a.keep else None
    with keep or tempfile.TemporaryDirectory(prefix=f"fleet{n}-") as td:
        run_dir = Path(td)
        job = Job(a, n, run_dir)
        row: dict = {"n": n, "ranks": n * a.ranks_per_node, "started": False}
        if a.keep:
            print(f"N={n}: run directory {run_dir}", flush=True)
        try:
            world = n * a.ranks_per_node
            t0 = time.monotonic()
            try:
                job._wait(lambda: (s := job.sup_stats()).get("up", 0) >= n + 1 and s.get("ready", 0) >= world, a.startup_timeout_s,
                          "every node up and every rank ready")
                row["started"], row["startup_s"] = True, time.monotonic() - t0
            except (TimeoutError, RuntimeError) as e:  # RuntimeError: the supervisor exited (it lost nodes that were late)
                s = job.sup_stats()
                row["startup_s"] = None
                row["not_started"] = (f"after {time.monotonic() - t0:.0f} s: {s.get('up', 0)}/{n + 1} nodes up, {s.get('ready', 0)}/{world} "
                                      f"ranks ready, {len([ev for ev in events(run_dir) if ev.get('type') == 'failure'])} failure events"
                                      + (f"; {e}" if isinstance(e, RuntimeError) else ""))
                if isinstance(e, RuntimeError):
                    return row
            time.sleep(1.0)
            row.update(steady(job, a.window_s))
            if row["started"]:
                row.update(incident(job, a))
        finally:
            job.close()
    return row


def fmt(v, spec: str = ".1f") -> str:
    return "-" if v is None or v != v else format(v, spec)


HEADER = (f"{'N':>6} {'ranks':>6} {'start s':>7} {'loop med/p99 ms':>16} {'status ms':>9} {'ops/s':>8} {'conns':>6} "
          f"{'sup CPU% (loop)':>15} {'RSS MB':>7} {'sim CPU%':>8} {'sim lag p99 ms':>14} {'detect s':>8} {'decide s':>8} "
          f"{'agents s':>8} {'gen seen s':>10} {'seen/live':>11} {'load':>5}")


def row_line(r: dict) -> str:
    return (f"{r['n']:>6} {r['ranks']:>6} {fmt(r.get('startup_s')):>7} {fmt(r.get('period_med_ms')) + '/' + fmt(r.get('period_p99_ms')):>16} "
            f"{fmt(r.get('status_write_ms')):>9} {fmt(r.get('ops_s'), '.0f'):>8} {r.get('conns', '-'):>6} "
            f"{fmt(r.get('cpu_proc'), '.0f') + ' (' + fmt(r.get('cpu_loop'), '.0f') + ')':>15} {fmt(r.get('rss_mb'), '.0f'):>7} "
            f"{fmt(r.get('cpu_sim'), '.0f'):>8} {fmt(r.get('sim_lag_p99_ms')):>14} {fmt(r.get('detect_s'), '.2f'):>8} "
            f"{fmt(r.get('decide_s'), '.2f'):>8} {fmt(r.get('relay_s'), '.3f'):>8} {fmt(r.get('propagate_s'), '.3f'):>10} "
            f"{str(r.get('seen', '-')) + '/' + str(r.get('live_ranks', '-')):>11} {fmt(r.get('load'), '.1f'):>5}")


def summary(a, rows: list[dict]) -> list[str]:
    """The growth laws with their data, and where each target breaks."""
    ns = [r["n"] for r in rows]
    out = ["", "Growth laws (rows above: measured on this machine; crossings past the largest N: extrapolated)"]
    out += fleet_fit.describe("loop period median", "ms", ns, [r.get("period_med_ms") for r in rows], None, "")
    out += fleet_fit.describe("loop period p99", "ms", ns, [r.get("period_p99_ms") for r in rows], None, "")
    out += fleet_fit.describe("supervisor process CPU", "% of a core", ns, [r.get("cpu_proc") for r in rows], 100.0,
                              "supervisor (loop + store) under one core")
    out += fleet_fit.describe("detection (loss -> failure event)", "s", ns, [r.get("detect_s") for r in rows], a.node_timeout_s + 1.0,
                              f"failure event within node_timeout_s + 1 = {a.node_timeout_s + 1:g} s")
    out += fleet_fit.describe("loss -> decision", "s", ns, [r.get("decide_s") for r in rows], None, "")
    out += fleet_fit.describe("generation seen by every rank", "s", ns, [r.get("propagate_s") for r in rows], 2.0,
                              "generation seen by every rank within 2 s")
    out += fleet_fit.describe("generation read by every agent (the central store's part)", "s", ns, [r.get("relay_s") for r in rows],
                              None, "")
    out += fleet_fit.describe("store round trips", "ops/s", ns, [r.get("ops_s") for r in rows], None, "")
    for r in rows:
        if r.get("seen_quantiles"):
            out.append(f"N={r['n']}: generation seen by half / 90 % of each simulation process's ranks after "
                       + ", ".join(f"{a:.3f} / {b:.3f} s" for a, b in r["seen_quantiles"]) + f" (all: {r['propagate_s']:.3f} s)")
    for r in rows:
        if r.get("members_kb"):
            out.append(f"N={r['n']}: the new generation's membership {r['members_kb']:.0f} KB whole (read by its joiners), "
                       f"{r.get('members_diff_b', 0)} B as its difference (``MembersDiff``: read by every other rank)")
    for r in rows:
        if not r.get("started"):
            out.append(f"N={r['n']}: did not start ({r.get('not_started')}); its steady-state columns are of the job as far as it got")
        elif r.get("propagate_s") is None:
            out.append(f"N={r['n']}: the generation was not seen by every live rank within {a.incident_timeout_s:g} s "
                       f"({r.get('seen')}/{r.get('live_ranks')})")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default=None, help="comma-separated node counts (default 10,100,1000,10000; --quick: 4,12)")
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2, help="simulation processes")
    ap.add_argument("--conns", type=int, default=4, help="store connections per simulation process (+2 notify watchers)")
    ap.add_argument("--window-s", type=float, default=5.0, help="the steady window")
    ap.add_argument("--heartbeat-s", type=float, default=0.5)
    ap.add_argument("--node-timeout-s", type=float, default=5.0)
    ap.add_argument("--startup-timeout-s", type=float, default=120.0)
    ap.add_argument("--incident-timeout-s", type=float, default=30.0)
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--quick", action="store_true", help="a smoke run: N=4,12, short windows")
    ap.add_argument("--keep", action="store_true", help="keep each N's run directory (its events, logs) and print it")
    a = ap.parse_args()
    if a.quick:
        a.nodes = a.nodes or "4,12"
        a.window_s, a.node_timeout_s, a.startup_timeout_s, a.incident_timeout_s = 2.0, 2.0, 30.0, 15.0
    sizes = [int(x) for x in (a.nodes or "10,100,1000,10000").split(",") if x]
    print(f"fleet: the real supervisor + store vs {a.workers} simulation processes x {a.conns} connections (+2 watchers each); "
          f"{a.ranks_per_node} ranks/node, 1 spare, heartbeat {a.heartbeat_s:g} s, node timeout {a.node_timeout_s:g} s; "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} at start", flush=True)
    print("A real job holds 3 + ranks connections per node to the store (the agent's and its two watchers': its commands, the "
          "ranks' counter it relays; each rank's control thread, and a rank's own watcher only while its agent's relay is not armed): "
          f"{3 + a.ranks_per_node} per node; this simulation holds {a.workers * (a.conns + 2)} in all, plus the "
          "supervisor's own. The store is a thread of the supervisor process: its CPU and RSS are in the supervisor's.", flush=True)
    print(HEADER, flush=True)
    rows = []
    for n in sizes:
        r = run_one(a, n)
        rows.append(r)
        print(row_line(r), flush=True)
    for line in summary(a, rows):
        print(line, flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    bad = [r["n"] for r in rows if not r.get("started") or r.get("detect_s") is None or r.get("propagate_s") is None]
    return 1 if bad else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Job.close ran on the way out (finally): its processes are gone
        sys.exit(130)
