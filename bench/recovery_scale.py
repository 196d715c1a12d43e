"""Hot-swap recovery time against the number of ranks, real ranks on this machine, and a fit to project it.

    python bench/recovery_scale.py [--ranks 4,8,16,32] [--repeats 1] [--quick] [--layout dp|hsdp|pp-dp] [--json-out PATH]

For each N: phoenix-run with N simulated nodes x 1 rank (gloo on CPU, the tiniest examples/train_gpt.py; with
``--layout hsdp`` or ``pp-dp`` the tiniest examples/train_llama.py as HSDP N/2 x 2 or PP 2 x DP N/2) and 1
warm spare, a job far longer than the measurement (stopped once it is taken). Once rank 0's step log shows the
job trains (``--warm-steps`` past its first step), node1 is SIGKILLed (``phoenix-run kill-node node1``: its
agent and its rank), the bench waits for the ``recovery`` event and records its phases, then samples every rank:
TCP sockets (ESTABLISHED, split by what the other end is: the control-plane store, another rank, a launcher
process, other) and threads, and the CPU seconds the ranks, agents and supervisor used from the kill until the
recovery event was read. Formation time per generation is read from the ranks' log lines ("every rank arrived" ->
"process groups formed"; in brackets, of it "-> default group formed": torch's world-sized gloo group, the rest is
PHOENIX's pair groups). ``--step-sleep S`` idles each rank S seconds a step: N ranks share this machine's few
cores, and their training would otherwise take the CPU from the recovery, which a rank with cores of its own
never sees.

Then a table per N (median over repeats), least-squares fits of recovery total and reconfigure against N and
against log2 N with R^2, a projection to 1K / 10K / 100K ranks next to the paper's figures, and the ratio
total(N_max) / total(N_min) measured in this run. ``--json-out`` also writes the per-N medians, with the date, commit,
cores and load they were taken at, in the form ``phoenix-run simulate --scale-from`` reads (bench/data/).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import psutil

from common import GPT, ROOT, env, events, med, phoenix, step_log, wait

# The tiniest model the example allows: the step is mostly the runtime's own work, not arithmetic.
TINY = ("--d-model", 8, "--layers", 1, "--heads", 1, "--seq", 4, "--batch", 1, "--vocab", 16, "--log-every", 100000)
LLAMA = str(ROOT / "examples" / "train_llama.py")
TINY_LLAMA = ("--d-model", 16, "--layers", 2, "--heads", 2, "--kv-heads", 1, "--seq", 4, "--batch", 2, "--vocab", 16,
              "--log-every", 100000)


def layout_args(layout: str, n: int, optimizer: str) -> list:
    """The script and its flags for ``--layout``: dp (examples/train_gpt.py, DDP with ``--optimizer``), hsdp (N/2
    replicas of 2 shards, examples/train_llama.py) or pp-dp (2 pipeline stages x DP N/2, 1F1B)."""
    if layout == "dp":
        return [GPT, *TINY, "--optimizer", optimizer]
    if n % 2:
        raise SystemExit(f"error: --layout {layout} needs an even N, got {n}")
    flags = ["--hsdp", n // 2] if layout == "hsdp" else ["--pp", 2, "--schedule", "1f1b"]
    return [LLAMA, *TINY_LLAMA, *flags]
PHASES = ("detect_s", "quiesce_s", "reconfigure_s", "param_restore_s", "optim_restore_s", "resume_s", "recovered_s", "total_s",
          "steps_replayed")
SOCK_KINDS = ("store", "ranks", "launcher", "other")
PAPER = "paper: 17 s at 64 GPUs, 30 s at 512 GPUs (~+4.3 s per doubling)"


# ------------------------------------------------------------------------------------------ one job

class Job:
    """A phoenix-run job in its own session; ``stop()`` kills every process of it (its agents lead groups of
    their own, so the whole tree is collected, not only the launcher's group)."""

    def __init__(self, d: Path, n: int, a):
        self.d, self.n, self.run_dir, self.log = d, n, d / "run", d / "steps.log"
        script, *flags = layout_args(a.layout, n, a.optimizer)
        cmd = phoenix("--nodes", n, "--nproc-per-node", 1, "--spares", 1, "--run-dir", self.run_dir,
                      script, "--steps", 10_000_000, "--step-log", self.log, *flags, "--step-sleep", a.step_sleep)
        self.out = open(d / "phoenix.out", "w")
        self.proc = subprocess.Popen(cmd, cwd=d, env=env(), stdout=self.out, stderr=subprocess.STDOUT, start_new_session=True)

    def tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self) -> None:
        procs = self.tree()
        groups = {self.proc.pid}
        for p in procs:
            try:
                groups.add(os.getpgid(p.pid))
            except ProcessLookupError:
                pass
        for g in groups:
            try:
                os.killpg(g, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        psutil.wait_procs(procs, timeout=10)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            print(f"  warning: launcher {self.proc.pid} did not exit after SIGKILL", file=sys.stderr)
        self.out.close()
        left = [p.pid for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if left:
            print(f"  warning: processes left after stop: {left}", file=sys.stderr)

    def alive(self) -> None:
        if self.proc.poll() is not None:
            tail = (self.d / "phoenix.out").read_text()[-1500:]
            raise RuntimeError(f"N={self.n}: phoenix-run exited ({self.proc.returncode}) early:\n{tail}")

    def steps(self) -> int:
        s, _ = step_log(self.log)
        return s[-1][0] if s else -1


def ranks_of(job: Job) -> dict[str, psutil.Process]:
    """Node name -> its rank process (1 rank a node; a warm spare's too). The node is read from the agent's spec
    path, not the environment: a spare's environment predates the rank it is assigned."""
    out = {}
    for p in job.tree():
        try:
            if "phoenix_runtime.plane.bootstrap" not in p.cmdline():
                continue
            spec = next((x for x in p.parent().cmdline() if x.endswith("agent.spec.json")), "")
        except (psutil.NoSuchProcess, AttributeError):
            continue
        out[Path(spec).parent.name or str(p.pid)] = p
    return out


# ------------------------------------------------------------------------------------------ sockets, threads

def port_owners(job: Job) -> dict[int, str]:
    """Local TCP port -> "rank" or "launcher", for every process of the job (the other end of a socket)."""
    owners = {}
    for p in job.tree():
        try:
            kind = "rank" if "phoenix_runtime.plane.bootstrap" in p.cmdline() else "launcher"
            for c in p.net_connections(kind="tcp"):
                owners[c.laddr.port] = kind
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return owners


def sample(job: Job, store_port: int) -> dict[str, dict]:
    """Per node (its one rank): ESTABLISHED TCP sockets by kind of peer, their total, and threads."""
    owners = port_owners(job)
    out = {}
    for r, p in sorted(ranks_of(job).items()):
        try:
            conns = [c for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_ESTABLISHED and c.raddr]
            threads = p.num_threads()
        except psutil.NoSuchProcess:
            continue
        kinds = dict.fromkeys(SOCK_KINDS, 0)
        peers = []
        for c in conns:
            if c.raddr.port == store_port:
                kinds["store"] += 1
            else:
                kind = {"rank": "ranks", "launcher": "launcher"}.get(owners.get(c.raddr.port), "other")
                kinds[kind] += 1
                if kind == "ranks":
                    peers.append((c.laddr.port, c.raddr.port))
        out[r] = {**kinds, "total": len(conns), "threads": threads, "peers": peers}
    return out


def cpu_seconds(job: Job) -> dict[int, tuple[str, float]]:
    """pid -> (role, user + system CPU seconds so far) of every live process of the job: "rank", "agent" (a
    node's launcher process) or "supervisor" (phoenix-run itself)."""
    out = {}
    for p in job.tree():
        try:
            cmd = " ".join(p.cmdline())
            t = p.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        role = "rank" if "phoenix_runtime.plane.bootstrap" in cmd else "supervisor" if p.pid == job.proc.pid else "agent"
        out[p.pid] = (role, t.user + t.system)
    return out


def cpu_used(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds each role used between two ``cpu_seconds`` samples (the processes alive at both)."""
    used: dict[str, float] = {}
    for pid, (role, t) in after.items():
        if pid in before:
            used[role] = used.get(role, 0.0) + t - before[pid][1]
    return used


# ------------------------------------------------------------------------------------------ formation times

LINE = re.compile(r"^\[phoenix (\d\d:\d\d:\d\d\.\d{3}) rank (\d+)\] generation (\d+): "
                  r"(every rank arrived|default group formed|process groups formed)")


def formation(run_dir: Path) -> dict[int, list[tuple[float, float]]]:
    """Generation -> every rank's (whole formation, of it the default group) seconds, from its log lines: "every
    rank arrived" -> "process groups formed", and -> "default group formed" (the pair groups are the rest)."""
    per: dict[tuple[int, Path], dict[str, float]] = {}
    for f in sorted((run_dir / "logs").glob("*/*.log")):
        if f.name == "agent.log":
            continue
        for line in f.read_text(errors="replace").splitlines():
            m = LINE.match(line)
            if m:
                t = datetime.strptime(m[1], "%H:%M:%S.%f")
                per.setdefault((int(m[3]), f), {})[m[4]] = t.hour * 3600 + t.minute * 60 + t.second + t.microsecond / 1e6
    out: dict[int, list[tuple[float, float]]] = {}
    for (gen, _), ts in per.items():
        if len(ts) == 3:
            t0 = ts["every rank arrived"]
            out.setdefault(gen, []).append(((ts["process groups formed"] - t0) % 86400, (ts["default group formed"] - t0) % 86400))
    return out


RESUMED = re.compile(r"^\[phoenix [\d:.]+ rank (\d+)\] generation (\d+): resumed at step \d+ \((\{.*\})\)")


def breakdowns(run_dir: Path, gen: int) -> dict[int, dict]:
    """Rank -> its recovery's breakdown in generation ``gen`` (the runtime's log line "resumed at step R ({...})":
    its phases, ``cpu_s``, every thread's CPU in the recovery, and ``store_calls``, its central round trips)."""
    import ast

    out = {}
    for f in sorted((run_dir / "logs").glob("*/*.log")):
        for line in f.read_text(errors="replace").splitlines():
            m = RESUMED.match(line)
            if m and int(m[2]) == gen:
                out[int(m[1])] = ast.literal_eval(m[3])
    return out


STAGES = ("arrived", "every rank arrived", "default group formed", "process groups formed", "plan:", "resumed at")
STAGE = re.compile(r"^\[phoenix (\d\d:\d\d:\d\d\.\d{3}) rank (\d+)\] generation (\d+): (" + "|".join(STAGES) + ")")


def critical_path(run_dir: Path, gen: int) -> dict[str, tuple[float, float]]:
    """The recovery's critical path as the ranks lived it: for each stage of generation ``gen`` (a rank arrived,
    saw every rank arrive, formed torch's group, formed its pairs, read the plan, resumed), (the first rank's, the
    last rank's) time after the kill (kill-node's ``injected`` event), from their log lines. Each stage begins only once
    the one before it ended on the ranks it waits for: the last rank's column is the path, the spread between
    the two columns is how far apart the ranks run (on 2 cores, N ranks queue for them)."""
    evs = events(run_dir)
    kill = next((e["t"] for e in evs if e["type"] == "injected"), None)  # kill-node's SIGKILL
    kill = kill if kill is not None else next((e["t"] for e in evs if e["type"] == "failure"), None)
    if kill is None:
        return {}
    k = datetime.fromtimestamp(kill)
    k_s = k.hour * 3600 + k.minute * 60 + k.second + k.microsecond / 1e6
    seen: dict[str, list[float]] = {}
    for f in sorted((run_dir / "logs").glob("*/*.log")):
        if f.name == "agent.log":
            continue
        for line in f.read_text(errors="replace").splitlines():
            m = STAGE.match(line)
            if m and int(m[3]) == gen:
                t = datetime.strptime(m[1], "%H:%M:%S.%f")
                seen.setdefault(m[4], []).append((t.hour * 3600 + t.minute * 60 + t.second + t.microsecond / 1e6 - k_s) % 86400)
    return {st: (min(v), max(v)) for st in STAGES if (v := seen.get(st))}


def opened(before: dict, after: dict) -> dict[str, int]:
    """Node -> the connections to other ranks its rank holds after the recovery that it did not hold before (the
    spare's rank: all of them): what the recovery and its first steps opened."""
    return {node: len(set(map(tuple, a["peers"])) - set(map(tuple, before.get(node, {}).get("peers", ()))))
            for node, a in after.items()}


# ------------------------------------------------------------------------------------------ one measurement

def measure(td: Path, n: int, rep: int, a) -> dict:
    d = td / f"n{n}-r{rep}"
    d.mkdir()
    job = Job(d, n, a)
    try:
        start = n * a.start_s_per_rank + 60
        wait(lambda: job.alive() or job.steps() >= 0, start, f"N={n}: no training step within {start:.0f} s")
        first = job.steps()
        wait(lambda: job.alive() or job.steps() >= first + a.warm_steps, 300, f"N={n}: {a.warm_steps} steps not done in 300 s")
        store_port = int(next(e for e in events(job.run_dir) if e["type"] == "job_start")["control"].rsplit(":", 1)[1])
        before = sample(job, store_port)
        spare = before.pop(f"node{n}", None)  # the warm spare (the last node) holds no rank yet
        step_at_kill, uptime = job.steps(), os.getloadavg()
        warm = [t for _, t in step_log(job.log)[0][-a.warm_steps:]]
        steady = med([b - a_ for a_, b in zip(warm, warm[1:])]) if len(warm) > 2 else float("nan")  # a step at this N
        cpu0, t0 = cpu_seconds(job), time.monotonic()
        r = subprocess.run(phoenix("kill-node", "node1", "--run-dir", job.run_dir), cwd=d, env=env(),
                           capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"N={n}: kill-node failed: {r.stderr[-500:]}")
        rec = wait(lambda: job.alive() or next((e for e in events(job.run_dir) if e["type"] == "recovery"), None),
                   a.recovery_wait_s, f"N={n}: no recovery event within {a.recovery_wait_s} s of the kill")
        cpu = cpu_used(cpu0, cpu_seconds(job))  # the kill, the recovery and the first steps after it
        cpu["window_s"] = time.monotonic() - t0
        after_step = job.steps()
        wait(lambda: job.alive() or job.steps() >= after_step + a.warm_steps, 300, f"N={n}: no training after recovery in 300 s")
        after = sample(job, store_port)
        per = breakdowns(job.run_dir, 1)
        path = critical_path(job.run_dir, 1)
        return {"n": n, "rec": rec, "before": before, "after": after, "forms": formation(job.run_dir), "spare": spare,
                "step_at_kill": step_at_kill, "load": uptime, "path": path, "cpu": cpu, "opened": opened(before, after), "steady_s": steady,
                "cpu_per_rank": [b.get("cpu_s", 0.0) for b in per.values()],
                "thread_cpu_per_rank": [b.get("thread_cpu_s", 0.0) for b in per.values()],
                "wall_per_rank": [sum(b.get(p, 0.0) for p in PHASES if p != "detect_s") for b in per.values()],
                "runq_per_rank": [b.get("runq_s", 0.0) for b in per.values()],
                "calls_per_rank": [b.get("store_calls", 0) for b in per.values() if "store_calls" in b]}
    finally:
        job.stop()


# ------------------------------------------------------------------------------------------ fits, printing

def fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares y = a + b x: (a, b, R^2)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    a0 = my - b * mx
    ss = sum((y - my) ** 2 for y in ys)
    res = sum((y - a0 - b * x) ** 2 for x, y in zip(xs, ys))
    return a0, b, (1 - res / ss) if ss else float("nan")


def print_table(res: list[dict]) -> None:
    print(f"\n{'N':>4s} " + " ".join(f"{p[:-2] if p.endswith('_s') else p:>10s}" for p in PHASES)
          + f" {'form g0 med/max(dflt)':>20s} {'form g1 med/max(dflt)':>20s} {'load1':>6s} {'runs':>5s}")
    for n in sorted({r["n"] for r in res}):
        rs = [r for r in res if r["n"] == n]
        cols = " ".join(f"{med([r['rec'][p] for r in rs]):10.3f}" for p in PHASES)
        forms = []
        for g in (0, 1):
            xs = [x for r in rs for x in r["forms"].get(g, [])]
            forms.append(f"{med([a for a, _ in xs]):6.3f}/{max((a for a, _ in xs), default=float('nan')):<6.3f}"
                         f"({med([b for _, b in xs]):.3f})" if xs else f"{'-':>20s}")
        print(f"{n:4d} {cols} {forms[0]:>20s} {forms[1]:>20s} {med([r['load'][0] for r in rs]):6.2f} {len(rs):5d}")


def print_sockets(res: list[dict]) -> None:
    print("\nper rank, ESTABLISHED TCP sockets (store / other ranks / launcher / other = total) and threads; "
          "before the kill and after recovery (median over ranks, [min-max] of the total):")
    for n in sorted({r["n"] for r in res}):
        r = next(x for x in res if x["n"] == n)
        for when in ("before", "after"):
            per = r[when].values()
            if not per:
                continue
            m = {k: med([p[k] for p in per]) for k in (*SOCK_KINDS, "total", "threads")}
            tot = [p["total"] for p in per]
            own = [p["ranks"] for p in per]  # gloo groups connect lazily: a rank's pairs, its ring neighbours
            print(f"  N={n:3d} {when:6s}: " + " / ".join(f"{m[k]:g}" for k in SOCK_KINDS)
                  + f" = {m['total']:g} [{min(tot)}-{max(tot)}], threads {m['threads']:g} ({len(per)} ranks); to other ranks "
                  f"besides torch's default group (N - 1 each): {med(own):g} [{min(own)}-{max(own)}]")
        if r["spare"]:
            sp = r["spare"]
            print(f"  N={n:3d} warm spare before its assignment: " + " / ".join(str(sp[k]) for k in SOCK_KINDS)
                  + f" = {sp['total']}, threads {sp['threads']}")
        print(f"  N={n:3d} per rank before: " + " ".join(f"{k}:{v['total']}s/{v['threads']}t" for k, v in r["before"].items()))


def print_fits(res: list[dict]) -> None:
    ns = sorted({r["n"] for r in res})
    if len(ns) < 2:
        print("\n(one N only: no fit)")
        return
    print("\nfits (least squares over the per-N medians; EXTRAPOLATED FROM N<=%d ON 2 SHARED CPU CORES):" % max(ns))
    for key in ("recovered_s", "total_s", "reconfigure_s"):
        ys = [med([r["rec"][key] for r in res if r["n"] == n]) for n in ns]
        print(f"  {key}: data " + ", ".join(f"N={n}: {y:.3f}" for n, y in zip(ns, ys)))
        for name, f in (("linear in N", float), ("linear in log2 N", math.log2)):
            a0, b, r2 = fit([f(n) for n in ns], ys)
            proj = ", ".join(f"{k}: {a0 + b * f(v):.1f} s" for k, v in (("1K", 1024), ("10K", 10_000), ("100K", 100_000)))
            unit = "per rank" if f is float else "per doubling"
            print(f"    {name:17s}: {a0:.3f} + {b:.4f} s {unit}, R^2 {r2:.3f}; projected {proj}")
    print(f"  {PAPER}; the paper's fit projected: 1K {30 + 4.3:.1f} s, 10K {30 + 4.3 * math.log2(10_000 / 512):.1f} s, "
          f"100K {30 + 4.3 * math.log2(100_000 / 512):.1f} s")
    lo, hi = ns[0], ns[-1]
    print()
    for key, what in (("recovered_s", "the kill -> every rank recovered"), ("total_s", "-> every rank's first step after it")):
        t_lo = med([r["rec"][key] for r in res if r["n"] == lo])
        t_hi = med([r["rec"][key] for r in res if r["n"] == hi])
        print(f"ratio {key}(N={hi}) / {key}(N={lo}) in this run ({what}): {t_hi / t_lo:.2f}x (target <= 2x)")
    print_cpu_floor(res, ns)
    print_runq(res)
    own = {n: med([r["rec"]["recovered_s"] - med([b for _, b in r["forms"].get(1, [])]) for r in res if r["n"] == n]) for n in (lo, hi)}
    print(f"ratio without torch's default group (recovered_s less the median rank's default-group formation in generation 1): "
          f"{own[hi]:.3f} / {own[lo]:.3f} s = {own[hi] / own[lo]:.2f}x")


def print_per_rank(res: list[dict]) -> None:
    """What one rank's recovery costs it, per N: connections to other ranks opened, central-store round trips, CPU
    seconds (median and max over the ranks; a repeat's medians pooled), and the critical path (the kill -> every
    rank's first step after the recovery); then each one's ratio between the largest and the smallest N."""
    ns = sorted({r["n"] for r in res})
    rows = {}
    print(f"\nper rank, the recovery alone (median / max over the ranks):\n{'N':>4s} {'conns opened':>14s} "
          f"{'store round trips':>18s} {'CPU s':>16s} {'kill->first step s':>19s} {'its thread CPU s':>18s}")
    for n in ns:
        rs = [r for r in res if r["n"] == n]
        conns = [c for r in rs for c in r["opened"].values()]
        calls = [c for r in rs for c in r["calls_per_rank"]]
        cpu = [c for r in rs for c in r["cpu_per_rank"]]
        crit = med([r["rec"]["total_s"] for r in rs])
        own = [c for r in rs for c in r.get("thread_cpu_per_rank", [])]
        rows[n] = (med(conns) if conns else float("nan"), med(calls) if calls else float("nan"), med(cpu) if cpu else float("nan"), crit,
                   med(own) if own else float("nan"))
        print(f"{n:4d} {rows[n][0]:7g} / {max(conns, default=0):<5g} {rows[n][1]:9g} / {max(calls, default=0):<6g} "
              f"{rows[n][2]:8.4f} / {max(cpu, default=0):<6.4f} {crit:19.3f} {rows[n][4]:9.4f} / {max(own, default=0):<6.4f}")
    if len(ns) > 1:
        lo, hi = ns[0], ns[-1]
        for i, (what, target) in enumerate((("connections opened per rank", 1.5), ("central round trips per rank", 1.5),
                                            ("CPU s per rank", 1.5), ("kill -> first step", 2.0))):
            a, b = rows[lo][i], rows[hi][i]
            ratio = b / a if a else float("inf") if b else 1.0
            print(f"  {what}: N={hi} / N={lo} = {ratio:.2f}x (target <= {target:g}x) {'met' if ratio <= target else 'NOT met'}")
        st = {n: med([r.get("steady_s", float("nan")) for r in res if r["n"] == n]) for n in (lo, hi)}
        fs = {n: med([r["rec"]["total_s"] - r["rec"]["recovered_s"] for r in res if r["n"] == n]) for n in (lo, hi)}
        print(f"  of kill -> first step, the first step after the recovery: {fs[lo]:.3f} s at N={lo}, {fs[hi]:.3f} s at N={hi}; "
              f"a steady step before the kill (its own time at that N on these cores): {st[lo]:.3f} / {st[hi]:.3f} s")
        tot = {n: med([r["rec"]["total_s"] for r in res if r["n"] == n]) for n in (lo, hi)}
        print(f"  kill -> first step in steady steps of its own N (this machine's 2 cores make a step of N={hi} "
              f"{st[hi] / st[lo]:.2f}x one of N={lo}): {tot[lo] / st[lo]:.2f} at N={lo}, {tot[hi] / st[hi]:.2f} at N={hi}, "
              f"{(tot[hi] / st[hi]) / (tot[lo] / st[lo]):.2f}x (a normalisation of this bench's, not the issue's target)")
        a, b = rows[lo][4], rows[hi][4]
        print(f"  of the CPU, the recovering thread's own: N={hi} / N={lo} = {b / a if a else float('nan'):.2f}x (the rest is the "
              "rank's other threads while it waits: it grows with the recovery's wall time, i.e. with this machine's load)")


def print_path(res: list[dict]) -> None:
    """``critical_path`` per N (median over repeats): each stage's last rank, and in brackets its first, seconds
    after the kill; then the first step after the recovery (the ``recovery`` event's total)."""
    ns = sorted({r["n"] for r in res})
    print("\nthe recovery's critical path, s after the kill: the last rank to reach each stage (the first in brackets)")
    print(f"{'N':>4s} " + " ".join(f"{st.rstrip(':'):>24s}" for st in STAGES) + f" {'first step done':>16s}")
    for n in ns:
        rs = [r for r in res if r["n"] == n and r.get("path")]
        if not rs:
            continue
        cells = []
        for st in STAGES:
            got = [r["path"][st] for r in rs if st in r["path"]]
            cells.append(f"{med([b for _, b in got]):.3f} ({med([a for a, _ in got]):.3f})" if got else "-")
        print(f"{n:4d} " + " ".join(f"{c:>24s}" for c in cells) + f" {med([r['rec']['total_s'] for r in rs]):16.3f}")


def print_runq(res: list[dict]) -> None:
    """Each rank's own recovery (its phases, from its quiesce to its resume) and, of its wall time, how long its
    recovering thread waited for a CPU while it could run (Linux's schedstat, the runtime's ``runq_s``): the part
    that is N ranks sharing this machine's cores. Ranks on cores of their own do not wait there; what is left
    (wall less that wait) still holds the waits on peers, who waited for a CPU too: an estimate, not a measure."""
    ns = sorted({r["n"] for r in res})
    rows = {}
    print("\nper rank, its own recovery's wall s / of it waiting for a CPU s / wall less that wait s (median over the ranks):")
    for n in ns:
        rs = [r for r in res if r["n"] == n]
        pairs = [(w, q) for r in rs for w, q in zip(r.get("wall_per_rank", []), r.get("runq_per_rank", []))]
        if not pairs:
            continue
        rows[n] = (med([w for w, _ in pairs]), med([q for _, q in pairs]), med([w - q for w, q in pairs]))
        print(f"  N={n:3d}: {rows[n][0]:.3f} / {rows[n][1]:.3f} / {rows[n][2]:.3f}")
    if len(rows) > 1:
        lo, hi = min(rows), max(rows)
        print(f"  wall: N={hi} / N={lo} = {rows[hi][0] / rows[lo][0]:.2f}x; less the wait for a CPU: "
              f"{rows[hi][2] / rows[lo][2]:.2f}x (an estimate; the target's figure is the kill -> first step above)")


def print_cpu_floor(res: list[dict], ns: list[int]) -> None:
    """Each rank's CPU in its recovery (the runtime's ``cpu_s``, every thread of the process, summed by the
    supervisor into ``rank_cpu_s``) and the floor it sets here: N ranks' CPU cannot take less than their sum
    over the machine's cores. Flat CPU per rank is what scales; the floor is this machine's, not the design's."""
    cores = os.cpu_count() or 1
    print(f"\nCPU of the ranks in their recovery (the kill's generation; {cores} cores here):")
    floors = {}
    for n in ns:
        rs = [r for r in res if r["n"] == n and r["rec"].get("rank_cpu_s")]
        if not rs:
            continue
        cpu = med([r["rec"]["rank_cpu_s"] for r in rs])
        rec = med([r["rec"]["recovered_s"] for r in rs])
        floor = floors[n] = cpu / cores
        print(f"  N={n:3d}: {cpu:.3f} CPU s in all, {cpu / n * 1000:.1f} ms per rank; floor {floor:.3f} s "
              f"(all of it over {cores} cores); recovered in {rec:.3f} s = {rec / floor:.1f}x the floor")
    lo, hi = ns[0], ns[-1]
    if len(ns) > 1 and hi in floors:
        total = {n: med([r["rec"]["total_s"] for r in res if r["n"] == n]) for n in (lo, hi)}
        first = med([r["rec"]["total_s"] - r["rec"]["recovered_s"] for r in res if r["n"] == hi])
        left = 2 * total[lo] - first  # what a 2x kill -> first step leaves from the kill to every rank recovered
        detect = med([r["rec"].get("detect_s", 0.0) for r in res if r["n"] == hi])
        need = detect + floors[hi]  # the ranks recover once the loss is detected; their CPU packed on every core
        print(f"  the 2x target at N={hi}: 2 x {total[lo]:.3f} s less its first step after the recovery ({first:.3f} s, "
              f"measured) leaves {left:.3f} s from the kill to every rank recovered; detection ({detect:.3f} s) and the "
              f"ranks' recovery CPU on {cores} cores ({floors[hi]:.3f} s) take at least {need:.3f} s without any wait "
              f"on a peer: {'within reach' if left > need else 'out of reach'} on this machine")


def best(fn, reps: int = 5):
    """The fastest of ``reps`` calls of ``fn`` (one process on a shared machine: the least disturbed) and its result."""
    times, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def print_pure_scale(sizes=(1_024, 10_240, 102_400)) -> list[dict]:
    """The recovery's per-generation pure work at sizes no run here reaches, measured (not extrapolated): the
    planning tree's work on its critical path (an inner rank merging ``FAN`` children's summaries with its own,
    once a level, then the root's plan from the job's summary; one joiner), the bytes a rank reads for it, the
    plan's bytes every other rank reads, and the steady pairs a rank derives for itself at each generation (8 ranks
    a node, k = 1)."""
    sys.path.insert(0, str(ROOT))
    from phoenix_runtime.layout import Layout, _ring_order
    from phoenix_launch.simulate.parts import tree_depth
    from phoenix_runtime.plane.exchange import FAN
    from phoenix_runtime.protection.pairs import steady_pairs
    from phoenix_runtime.recover.recovery import Descriptor, Summary, plan_layout

    print(f"\nthe recovery's pure parts at scale (measured here, one process; 8 ranks a node, one joiner, k = 1; "
          f"a planning tree of {FAN} children a rank):")
    rows = []
    for n in sizes:
        layout = Layout(n, nodes=tuple(f"n{r // 8}" for r in range(n)))
        ring = layout.replica_ring(0, 1)
        before = {ring[i]: ring[i - 1] for i in range(n)}  # whose replica each rank holds (its ring predecessor's)
        desc = lambda r: (Descriptor(r, True, 9, True, (8, 9), {str(layout.shard_of(before[r])): [8, 9]}) if r != 1  # noqa: E731
                          else Descriptor(1, False))
        interest = (str(layout.shard_of(1)),)
        depth = tree_depth(n, FAN)
        kids = [desc(r).to_json() for r in range(FAN + 1)]  # an inner rank's own descriptor and its leaves'
        merge_s, inner = best(lambda: Summary.merge([Summary.of(Descriptor.from_json(d), interest) for d in kids]).to_json())
        # the root's summary: as many ranks as the job's (what it reads is FAN summaries, merged as above)
        held = Summary.from_json(inner).holders
        job = Summary(n - 1, {8: n - 1, 9: n - 1}, 9, 0, (1,), {}, held, interest)
        plan_s, course = best(lambda: plan_layout(job, layout, n, replicated=False))

        def pairs_now():
            _ring_order.cache_clear()  # a new generation's layout: its ring is not cached yet
            return steady_pairs(layout, 1, n // 2)  # what one rank forms: its own pairs (its DP group's ring included)

        pairs_s, pairs = best(pairs_now)
        wire = len(course.to_json())
        path = depth * merge_s + plan_s
        read_kb = sum(map(len, kids[1:])) / 1e3
        rows.append({"ranks": n, "plan_s": round(path, 5), "merge_s": round(merge_s, 5), "root_plan_s": round(plan_s, 5),
                     "depth": depth, "fan": FAN, "summary_b": len(inner), "read_kb": round(read_kb, 2), "pairs_s": round(pairs_s, 4),
                     "descriptors_mb": round(len(kids[2]) * n / 1e6, 2)})
        print(f"  N={n:6d}: planning tree {depth} levels, {1000 * path:6.2f} ms on its path ({1000 * merge_s:.2f} ms a "
              f"level, the root's plan {1000 * plan_s:.2f} ms, {course.outcome.value}); a rank reads at most "
              f"{read_kb:.1f} kB (every descriptor: {len(kids[2]) * n / 1e6:.1f} MB), the plan every other rank reads "
              f"{wire} B; a rank's steady pairs {1000 * pairs_s:6.1f} ms ({len(pairs)} pairs)")
    return rows


def git_commit() -> str:
    """The checkout's short commit, "+dirty" when it has uncommitted changes; "unknown" outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                               text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def write_json(res: list[dict], path: Path, commit: str, what: str = "", pure: list[dict] | None = None) -> None:
    """Per-N medians of recovery total and reconfigure, and where and when they were measured, as JSON. ``commit``
    is read when the run starts: the checkout may change while it runs."""
    date, cores = datetime.now().astimezone().isoformat(timespec="seconds"), os.cpu_count()
    points = []
    for n in sorted({r["n"] for r in res}):
        rs = [r for r in res if r["n"] == n]
        points.append({"ranks": n, "total_s": med([r["rec"]["total_s"] for r in rs]), "recovered_s": med([r["rec"]["recovered_s"] for r in rs]),
                       "reconfigure_s": med([r["rec"]["reconfigure_s"] for r in rs]), "repeats": len(rs),
                       "rank_cpu_s": med([r["rec"].get("rank_cpu_s") or 0.0 for r in rs]),
                       # a rank's round trips to the central store in its recovery (median over the ranks): N of them
                       # are served one at a time by the store (simulate's central-store part)
                       "store_calls": med([c for r in rs for c in r["calls_per_rank"]]) if any(r["calls_per_rank"] for r in rs) else None,
                       "date": date, "commit": commit, "cores": cores, "load1": med([r["load"][0] for r in rs])})
    doc = {"source": "bench/recovery_scale.py", "date": date, "commit": commit, "cores": cores, "job": what, "points": points,
           "pure": pure or []}  # the plan and a rank's own ring at 1K-100K ranks, one process (print_pure_scale)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {len(points)} points to {path}")


def _sigterm(*_):
    raise KeyboardInterrupt  # SIGTERM takes the same path as Ctrl-C: the running job is stopped in measure's finally


def main():
    signal.signal(signal.SIGTERM, _sigterm)
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="4,8,16,32")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="N = 4, 8 once: a check that the bench works")
    ap.add_argument("--warm-steps", type=int, default=20, help="steps past the first before the kill, and after recovery")
    ap.add_argument("--start-s-per-rank", type=float, default=8.0, help="the deadline for the first step: this x N + 60 s")
    ap.add_argument("--recovery-wait-s", type=float, default=240.0)
    ap.add_argument("--step-sleep", type=float, default=0.0,
                    help="seconds each rank sleeps per step: with N ranks on a few cores, the ranks' training otherwise "
                         "contends for the CPU with the recovery, which ranks on their own GPUs and cores never do")
    ap.add_argument("--optimizer", choices=["zero", "adam", "adamw"], default="zero",
                    help="the example's optimizer: zero (ZeroRedundancyOptimizer: each owner broadcasts its shard, which on "
                         "gloo connects every rank to ~2 log2 N peers) or adamw (plain DDP: the ring's two neighbours)")
    ap.add_argument("--layout", choices=["dp", "hsdp", "pp-dp"], default="dp",
                    help="dp: DDP (examples/train_gpt.py, --optimizer); hsdp: HSDP N/2 x 2; pp-dp: PP 2 x DP N/2 "
                         "(examples/train_llama.py)")
    ap.add_argument("--json-out", type=Path, help="also write the per-N medians as JSON (for simulate --scale-from)")
    ap.add_argument("--keep", type=Path, help="copy each run's folder (events, the ranks' logs) under this folder")
    a = ap.parse_args()
    ns = [4, 8] if a.quick else [int(x) for x in a.ranks.split(",")]
    reps = 1 if a.quick else a.repeats
    commit = git_commit()
    what = f"optimizer {a.optimizer}" if a.layout == "dp" else f"layout {a.layout}"
    print(f"load before: {os.getloadavg()}, {os.cpu_count()} CPUs, commit {commit}, {what}")
    res, failed = [], []
    with tempfile.TemporaryDirectory(prefix="recovery_scale-") as td:
        for n in ns:
            for rep in range(reps):
                t0 = time.monotonic()
                try:
                    r = measure(Path(td), n, rep, a)
                except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as e:
                    kept = Path(tempfile.gettempdir()) / f"recovery_scale-failed-n{n}-r{rep}-{int(time.time())}"
                    shutil.copytree(Path(td) / f"n{n}-r{rep}", kept, dirs_exist_ok=True)  # its events and logs, to read
                    print(f"N={n} repeat {rep}: FAILED: {e} (its run kept in {kept})", file=sys.stderr)
                    failed.append((n, rep, str(e)[:300]))
                    continue
                res.append(r)
                if a.keep:
                    shutil.copytree(Path(td) / f"n{n}-r{rep}", a.keep / f"n{n}-r{rep}", dirs_exist_ok=True,
                                    ignore=shutil.ignore_patterns("*.sock"))
                print(f"N={n} repeat {rep}: total {r['rec']['total_s']} s, reconfigure {r['rec']['reconfigure_s']} s, "
                      f"killed at step {r['step_at_kill']}, load {r['load'][0]:.2f} ({time.monotonic() - t0:.0f} s); "
                      "CPU s from the kill to the recovery event seen: " + ", ".join(f"{k} {v:.2f}" for k, v in r["cpu"].items()),
                      flush=True)
    if res:
        print_table(res)
        print_per_rank(res)
        print_path(res)
        print_sockets(res)
        print_fits(res)
    pure = print_pure_scale()
    if res and a.json_out:
        write_json(res, a.json_out, commit, what, pure)
    for n, rep, why in failed:
        print(f"FAILED N={n} repeat {rep}: {why}")
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
