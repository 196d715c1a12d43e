"""Everything PHOENIX knows about the Slurm job it runs in: the ONE place that reads ``SLURM_*``.

Torch-free and import-light (stdlib only). Other modules get a frozen :class:`SlurmJob` from
:meth:`SlurmJob.from_env` and the argv lists built here (``drain_command``, ``agent_srun_command``);
they never look at ``os.environ["SLURM_..."]`` themselves.

Slurm 22.05 behaviour this module relies on (the test cluster: ``slurm/cluster/up.sh``):

* ``SLURM_PROCID``, ``SLURM_NODEID``, ``SLURM_NNODES``, ``SLURM_NTASKS`` describe the *step*, not the job:
  ``srun -N2 -w n3,n4`` gives n3 NODEID=0. They are exposed as :class:`SlurmStep`, never as a node's rank
  in the job.
* After a ``--no-kill`` job loses a node, the env still shows the original ``SLURM_JOB_NODELIST``; the live
  list is only in ``scontrol show job`` (:func:`job_nodes`).
* Slurm 22.05 does not report ``--no-kill`` anywhere a job can read it: ``scontrol show job`` (also ``-d``),
  ``squeue --json`` and the batch/step environment are identical with and without it. Newer Slurm
  (data_parser v0.0.41, 24.05) puts ``kill_on_node_fail`` in ``scontrol --json show job``.
  See :func:`detect_no_kill` for the order in which evidence is used.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Mapping, Sequence

from phoenix_runtime.errors import BackendError

__all__ = [
    "COMMAND_TIMEOUT",
    "NotInAllocation",
    "Runner",
    "SlurmCommandError",
    "SlurmEnvError",
    "SlurmJob",
    "SlurmStep",
    "agent_srun_command",
    "detect_no_kill",
    "drain_command",
    "expand_counts",
    "expand_hostlist",
    "expand_hostlist_pure",
    "in_allocation",
    "job_nodes",
    "parse_batch_script_no_kill",
    "parse_kv_record",
    "parse_topology",
    "run_command",
    "spare_batch_script",
    "submit_environ",
]

#: Deadline for one Slurm client command (scontrol/squeue answer in milliseconds when slurmctld is up).
COMMAND_TIMEOUT = timedelta(seconds=15)


class SlurmEnvError(BackendError, ValueError):
    """A SLURM_* variable or a Slurm command's output could not be understood."""


class NotInAllocation(SlurmEnvError):
    """``SlurmJob.from_env`` was called outside a Slurm allocation (no SLURM_JOB_ID)."""


#: Job states after which a job will never run again (a replenishment job in one of them did not deliver).
ENDED_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                          "DEADLINE", "PREEMPTED", "SPECIAL_EXIT", "REVOKED"})


class SlurmCommandError(BackendError, RuntimeError):
    """A Slurm client command failed, timed out, or is not installed."""

    def __init__(self, argv: Sequence[str], detail: str) -> None:
        super().__init__(f"{shlex.join(argv)}: {detail}")
        self.argv = list(argv)
        self.detail = detail


#: Runs argv and returns its stdout; raises SlurmCommandError on any failure. Injected so tests can fake it.
Runner = Callable[[Sequence[str]], str]


def run_command(argv: Sequence[str], *, timeout: timedelta = COMMAND_TIMEOUT,
                env: Mapping[str, str] | None = None) -> str:
    """The default :data:`Runner`: ``subprocess.run`` with a deadline; non-zero exit is an error."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, check=False,
                              timeout=timeout.total_seconds(), env=None if env is None else dict(env))
    except FileNotFoundError:
        raise SlurmCommandError(argv, "command not found") from None
    except subprocess.TimeoutExpired:
        raise SlurmCommandError(argv, f"timed out after {timeout.total_seconds():g}s") from None
    if proc.returncode != 0:
        raise SlurmCommandError(argv, f"exit {proc.returncode}: {proc.stderr.strip()[:500]}")
    return proc.stdout


# --------------------------------------------------------------------------------------------------
# hostlists and counted lists
# --------------------------------------------------------------------------------------------------

_BRACKET = re.compile(r"\[([^\[\]]*)\]")


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets: ``a[1,2],b`` -> ``['a[1,2]', 'b']``."""
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SlurmEnvError(f"unbalanced ']' in hostlist {text!r}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise SlurmEnvError(f"unbalanced '[' in hostlist {text!r}")
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _expand_ranges(spec: str, whole: str) -> list[str]:
    """``1-3,05`` -> ['1','2','3','05']; zero padding follows the width of the range's first number."""
    out: list[str] = []
    for item in spec.split(","):
        item = item.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not m:
            raise SlurmEnvError(f"bad range {item!r} in hostlist {whole!r}")
        lo, hi = m.group(1), m.group(2)
        if hi is None:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise SlurmEnvError(f"descending range {item!r} in hostlist {whole!r}")
        if int(hi) - int(lo) > 1_000_000:
            raise SlurmEnvError(f"range {item!r} too large in hostlist {whole!r}")
        width = len(lo)
        out.extend(str(v).zfill(width) for v in range(int(lo), int(hi) + 1))
    return out


def expand_hostlist_pure(text: str) -> tuple[str, ...]:
    """Pure-Python expansion of Slurm hostlist syntax, for the forms Slurm prints.

    ``n[1-3,5]`` -> n1 n2 n3 n5; ``nid[001234-001236]`` -> zero-padded; ``a,b[1-2]`` and several bracket
    groups (``r[1-2]n[1-2]``, cartesian product, first group outermost) are handled. Order is kept and
    duplicates are not removed (as ``scontrol show hostnames``).
    """
    text = text.strip()
    if not text or text == "(null)":
        return ()
    hosts: list[str] = []
    for part in _split_top_level(text):
        pieces = [part]
        while any("[" in p for p in pieces):
            nxt: list[str] = []
            for p in pieces:
                m = _BRACKET.search(p)
                if m is None:
                    if "[" in p or "]" in p:
                        raise SlurmEnvError(f"bad brackets in hostlist {text!r}")
                    nxt.append(p)
                    continue
                head, tail = p[: m.start()], p[m.end():]
                nxt.extend(head + v + tail for v in _expand_ranges(m.group(1), text))
            pieces = nxt
        for p in pieces:
            if "]" in p or any(c.isspace() for c in p):
                raise SlurmEnvError(f"bad host name {p!r} in hostlist {text!r}")
        hosts.extend(pieces)
    return tuple(hosts)


def expand_hostlist(text: str, *, run: Runner | None = run_command) -> tuple[str, ...]:
    """Expand a hostlist with ``scontrol show hostnames`` (the authority); fall back to
    :func:`expand_hostlist_pure` when scontrol is missing or fails, or when ``run`` is None."""
    text = text.strip()
    if not text or text == "(null)":
        return ()
    if run is not None:
        try:
            out = run(["scontrol", "show", "hostnames", text])
        except SlurmCommandError:
            pass
        else:
            names = tuple(line.strip() for line in out.splitlines() if line.strip())
            if names:
                return names
    return expand_hostlist_pure(text)


def expand_counts(text: str) -> tuple[int, ...]:
    """Slurm's counted lists: ``2(x3),1`` -> (2, 2, 2, 1) (SLURM_JOB_CPUS_PER_NODE, SLURM_TASKS_PER_NODE)."""
    out: list[int] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item)
        if not m:
            raise SlurmEnvError(f"bad counted list {text!r}")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return tuple(out)


# --------------------------------------------------------------------------------------------------
# scontrol output
# --------------------------------------------------------------------------------------------------

def parse_kv_record(text: str) -> dict[str, str]:
    """``Key=Value`` pairs of one ``scontrol show ...`` record (one-line ``-o`` or multi-line form).

    Values run to the next `` Key=`` so that values with spaces (``Reason=phoenix: x``) survive only when
    they are the last field; the fields PHOENIX reads (JobId, JobState, NodeList, BatchHost, NumNodes) have
    no spaces.
    """
    out: dict[str, str] = {}
    for m in re.finditer(r"(?:^|\s)([A-Za-z][A-Za-z0-9_/:]*)=(\S*)", text):
        out.setdefault(m.group(1), m.group(2))
    return out


def parse_topology(text: str) -> dict[str, str]:
    """``scontrol show topology`` -> {node: leaf switch}.

    Each node is mapped to the lowest-level switch that lists it (``Level=0`` leaves); higher switches
    (``top ... Nodes=n[1-5] Switches=s[1-2]``) list every node below them and are ignored for a node that a
    lower switch already claims. Pure: hostlists are expanded with :func:`expand_hostlist_pure`.
    """
    best: dict[str, tuple[int, str]] = {}
    for line in text.splitlines():
        rec = parse_kv_record(line)
        name = rec.get("SwitchName")
        if not name:
            continue
        try:
            level = int(rec.get("Level", "0"))
        except ValueError:
            raise SlurmEnvError(f"bad Level in topology line {line!r}") from None
        for node in expand_hostlist_pure(rec.get("Nodes", "")):
            if node not in best or level < best[node][0]:
                best[node] = (level, name)
    return {node: sw for node, (_, sw) in best.items()}


def job_nodes(job_id: str, *, run: Runner = run_command) -> tuple[str, ...]:
    """The job's *current* node list from ``scontrol show job`` (shrinks after a --no-kill node failure,
    unlike SLURM_JOB_NODELIST)."""
    rec = parse_kv_record(run(["scontrol", "-o", "show", "job", str(job_id)]))
    if "NodeList" not in rec:
        raise SlurmEnvError(f"no NodeList in scontrol show job {job_id}")
    return expand_hostlist(rec["NodeList"], run=run)


# --------------------------------------------------------------------------------------------------
# --no-kill
# --------------------------------------------------------------------------------------------------

def parse_batch_script_no_kill(script: str) -> bool | None:
    """What the ``#SBATCH`` directives of a batch script say about ``--no-kill``.

    True for ``-k``/``--no-kill``, False for ``--no-kill=off``, None when no directive mentions it.
    Like sbatch, directives are read only until the first line that is neither blank nor a comment.
    """
    verdict: bool | None = None
    for line in script.splitlines():
        s = line.strip()
        if not s:
            continue
        if not s.startswith("#"):
            break
        if not s.startswith("#SBATCH"):
            continue
        try:
            tokens = shlex.split(s[len("#SBATCH"):], comments=True)
        except ValueError:
            continue
        for tok in tokens:
            if tok in ("-k", "--no-kill", "--no-kill=on", "--no-kill=yes"):
                verdict = True
            elif tok == "--no-kill=off":
                verdict = False
    return verdict


def detect_no_kill(job_id: str, environ: Mapping[str, str], *,
                   run: Runner | None = run_command) -> tuple[bool | None, str]:
    """Was the job submitted with ``--no-kill``? Returns (answer or None when unknowable, where from).

    Evidence, strongest first:
    1. ``scontrol --json show job ID`` with a ``kill_on_node_fail`` field (Slurm >= 24.05; 22.05's scontrol
       has no --json and its ``squeue --json`` lacks the field).
    2. The batch script's ``#SBATCH`` lines (``scontrol write batch_script ID -``): ``--no-kill`` there is
       proof; its absence proves nothing, because ``sbatch --no-kill script`` leaves no trace in the script.
    3. ``SBATCH_NO_KILL`` in the job's environment (sbatch's input variable, inherited by the job).
    Otherwise (None, reason).
    """
    if run is not None:
        try:
            data = json.loads(run(["scontrol", "--json", "show", "job", str(job_id)]))
        except (SlurmCommandError, ValueError):
            pass
        else:
            for job in data.get("jobs", []) if isinstance(data, dict) else []:
                if str(job.get("job_id")) == str(job_id).split("_")[0] and "kill_on_node_fail" in job:
                    return (not bool(job["kill_on_node_fail"]), "scontrol --json: kill_on_node_fail")
        try:
            script = run(["scontrol", "write", "batch_script", str(job_id), "-"])
        except SlurmCommandError:
            pass
        else:
            verdict = parse_batch_script_no_kill(script)
            if verdict is not None:
                return verdict, "batch script #SBATCH directive"
    env_flag = environ.get("SBATCH_NO_KILL")
    if env_flag is not None:
        return (env_flag.strip().lower() not in ("off", "0", "no", "false")), "SBATCH_NO_KILL in the job env"
    return None, ("unknown: Slurm 22.05 does not report --no-kill in scontrol show job, squeue --json or the "
                  "env, and the batch script has no '#SBATCH --no-kill'")


# --------------------------------------------------------------------------------------------------
# the job
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SlurmStep:
    """The job step this process runs in. All of it is step-relative: in ``srun -N1 -w n4`` on a 4-node job,
    ``node_id`` is 0 and ``num_nodes`` 1. Never use it as the node's position in the job."""

    step_id: str
    nodelist: tuple[str, ...]
    num_nodes: int
    num_tasks: int | None
    proc_id: int
    node_id: int
    local_id: int


@dataclass(frozen=True)
class SlurmJob:
    """A Slurm allocation as seen from inside it. Build it with :meth:`from_env`."""

    job_id: str
    #: SLURM_JOB_NODELIST expanded: the allocation *at start*. See :func:`job_nodes` for the live list.
    nodelist: tuple[str, ...]
    num_nodes: int
    #: SLURMD_NODENAME: the node this process runs on (None in an salloc shell on the login/submit host).
    node_name: str | None
    #: BatchHost from scontrol (the node running the batch script); None for salloc or when not queried.
    batch_host: str | None
    submit_dir: str | None
    submit_host: str | None
    job_name: str | None
    partition: str | None
    account: str | None
    cluster_name: str | None
    #: per node of ``nodelist``, from SLURM_JOB_CPUS_PER_NODE (``2(x4)``); empty when not set
    cpus_per_node: tuple[int, ...]
    #: SLURM_NTASKS_PER_NODE (a job or step request), None when not requested
    tasks_per_node: int | None
    #: GPUs on this node (SLURM_GPUS_ON_NODE) or requested per node (SLURM_GPUS_PER_NODE), None if none
    gpus_per_node: int | None
    #: SLURM_JOB_GPUS: GPU indices on this node, empty when none
    gpu_ids: tuple[str, ...]
    #: SLURM_TOPOLOGY_ADDR, e.g. ``top.s1.n1`` under topology/tree
    topology_addr: str | None
    #: submitted with --no-kill? None when it cannot be known (see detect_no_kill)
    no_kill: bool | None
    no_kill_source: str
    #: SLURM_NO_KILL is set: sruns in this job default to --no-kill (sbatch --no-kill does NOT set it)
    steps_no_kill: bool
    step: SlurmStep | None = field(default=None)

    @property
    def batch_or_this_host(self) -> str | None:
        """BatchHost when known, else this node, else the first node of the allocation."""
        return self.batch_host or self.node_name or (self.nodelist[0] if self.nodelist else None)

    @classmethod
    def from_env(cls, environ: Mapping[str, str], *, run: Runner | None = run_command) -> "SlurmJob":
        """Read the job from ``environ`` (pass ``os.environ``). With ``run`` (the default runs real
        commands) the hostlist is expanded by scontrol, BatchHost is queried and --no-kill is detected; with
        ``run=None`` nothing is executed (pure; BatchHost None, no_kill from the env only).

        Raises NotInAllocation without SLURM_JOB_ID, SlurmEnvError on malformed values.
        """
        env = environ
        job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        if not job_id:
            raise NotInAllocation("not inside a Slurm allocation: SLURM_JOB_ID is not set")

        def opt(name: str) -> str | None:
            v = env.get(name)
            return v if v not in (None, "", "(null)") else None

        def opt_int(*names: str) -> int | None:
            for name in names:
                v = opt(name)
                if v is None:
                    continue
                m = re.fullmatch(r"(?:.*:)?(\d+)", v.strip())  # "4", "a100:4", "gpu:a100:4"
                if not m:
                    raise SlurmEnvError(f"{name}={v!r} is not an integer")
                return int(m.group(1))
            return None

        raw_nodes = opt("SLURM_JOB_NODELIST") or opt("SLURM_NODELIST") or ""
        nodelist = expand_hostlist(raw_nodes, run=run)
        num_nodes = opt_int("SLURM_JOB_NUM_NODES") or len(nodelist)
        if nodelist and num_nodes != len(nodelist):
            raise SlurmEnvError(f"SLURM_JOB_NUM_NODES={num_nodes} but SLURM_JOB_NODELIST has "
                                f"{len(nodelist)} nodes ({raw_nodes})")
        cpus = expand_counts(opt("SLURM_JOB_CPUS_PER_NODE") or "")

        step = None
        step_id = opt("SLURM_STEP_ID") or opt("SLURM_STEPID")
        if step_id is not None:
            step_nodes = expand_hostlist(opt("SLURM_STEP_NODELIST") or "", run=run)
            step = SlurmStep(
                step_id=step_id,
                nodelist=step_nodes,
                num_nodes=opt_int("SLURM_STEP_NUM_NODES", "SLURM_NNODES") or len(step_nodes),
                num_tasks=opt_int("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"),
                proc_id=opt_int("SLURM_PROCID") or 0,
                node_id=opt_int("SLURM_NODEID") or 0,
                local_id=opt_int("SLURM_LOCALID") or 0,
            )

        batch_host = _batch_host(job_id, run) if run is not None else None
        no_kill, source = detect_no_kill(job_id, env, run=run)
        steps_no_kill = opt("SLURM_NO_KILL") is not None and env["SLURM_NO_KILL"].lower() != "off"

        return cls(
            job_id=job_id,
            nodelist=nodelist,
            num_nodes=num_nodes,
            node_name=opt("SLURMD_NODENAME"),
            batch_host=batch_host,
            submit_dir=opt("SLURM_SUBMIT_DIR"),
            submit_host=opt("SLURM_SUBMIT_HOST"),
            job_name=opt("SLURM_JOB_NAME"),
            partition=opt("SLURM_JOB_PARTITION"),
            account=opt("SLURM_JOB_ACCOUNT"),
            cluster_name=opt("SLURM_CLUSTER_NAME"),
            cpus_per_node=cpus,
            tasks_per_node=opt_int("SLURM_NTASKS_PER_NODE"),
            gpus_per_node=opt_int("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"),
            gpu_ids=tuple(g for g in (opt("SLURM_JOB_GPUS") or "").split(",") if g),
            topology_addr=opt("SLURM_TOPOLOGY_ADDR"),
            no_kill=no_kill,
            no_kill_source=source,
            steps_no_kill=steps_no_kill,
            step=step,
        )


def _batch_host(job_id: str, run: Runner) -> str | None:
    """The job's BatchHost (``scontrol show job``), or None when unknown."""
    try:
        rec = parse_kv_record(run(["scontrol", "-o", "show", "job", job_id]))
    except SlurmCommandError:
        return None
    return rec.get("BatchHost") if rec.get("BatchHost") not in (None, "", "(null)") else None


def in_allocation(environ: Mapping[str, str]) -> bool:
    """True inside ``sbatch``/``salloc``/``srun`` (SLURM_JOB_ID is set)."""
    return bool(environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID"))


def job_id_of(environ: Mapping[str, str]) -> str | None:
    """The job id when inside an allocation (a number), else None: no scontrol, no other variable read."""
    job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID") or ""
    return job if job.isdigit() else None


def requeue_count(environ: Mapping[str, str]) -> int:
    """SLURM_RESTART_COUNT: how many times this batch job was requeued (0 when not, or not in Slurm)."""
    v = environ.get("SLURM_RESTART_COUNT", "0").strip()
    return int(v) if v.isdigit() else 0


# --------------------------------------------------------------------------------------------------
# commands
# --------------------------------------------------------------------------------------------------

_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _check_node(node: str) -> str:
    if not isinstance(node, str) or not _NODE_NAME.fullmatch(node):
        raise ValueError(f"not a single Slurm node name: {node!r}")
    return node


def drain_command(node: str, reason: str) -> list[str]:
    """argv that drains ``node`` with reason ``phoenix: <reason>``.

    A drained node keeps running the current job's steps (the recipe: ``draining``, new steps in the job can
    still use it) but gets no new jobs until an admin resumes it, so a node PHOENIX judged bad is not handed
    to the next job. Needs operator/admin rights on real clusters; callers treat failure as a warning.
    """
    _check_node(node)
    reason = " ".join(str(reason).split())  # one line, no control characters
    if not reason.startswith("phoenix:"):
        reason = f"phoenix: {reason}" if reason else "phoenix"
    return ["scontrol", "update", f"nodename={node}", "state=drain", f"reason={reason}"]


def agent_srun_command(node: str, argv: Sequence[str], extra: Sequence[str] = (), *,
                       gpus_per_node: int | None = None, step_name: str = "phoenix-agent") -> list[str]:
    """argv that starts ONE PHOENIX agent on ONE node as its own job step.

    Each node gets its own step so that a node's death ends only that node's step; the supervisor sees it
    as that srun exiting and replaces the node with a spare by starting another step.
    """
    _check_node(node)
    if not argv:
        raise ValueError("agent argv is empty")
    cmd = [
        "srun",
        # One node, one task: the agent itself spawns the node's ranks. SLURM_PROCID/SLURM_NODEID are
        # step-relative (every agent sees 0/0), so the agent's node rank is passed by the supervisor in argv,
        # never derived from Slurm.
        "--nodes=1",
        "--ntasks=1",
        "-w", node,
        # A plain step on a node already used by another step blocks *silently* until that step ends
        # (recipe section 6). --overlap lets the agent start at once next to a step that is still completing
        # (a replaced agent, a spare reused), and shares CPUs, memory and GRES with other steps.
        "--overlap",
        # The agent's exit code is PHOENIX's business: never let a non-zero exit terminate the step or
        # anything else, whatever the site's KillOnBadExit or an inherited SLURM_KILL_BAD_EXIT says.
        # (The =0 form is required: -K's argument is optional.)
        "--kill-on-bad-exit=0",
        # sbatch/salloc --no-kill keep the *job* alive when a node fails, but do not set SLURM_NO_KILL,
        # so steps are still killed on node failure unless srun asks (sbatch man page). With --no-kill on
        # the step, a failure elsewhere in the allocation never tears this node's agent down; only the
        # death of this node ends this step.
        "--no-kill",
        f"--job-name={step_name}",
    ]
    if gpus_per_node:
        # Steps get all non-GPU resources of the node by default, but GPUs only when asked for.
        cmd.append(f"--gpus-per-node={int(gpus_per_node)}")
    cmd.extend(extra)
    cmd.extend(argv)
    return cmd


def submit_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment for ``sbatch`` run from inside a job: without this job's ``SLURM_*``, ``SLURMD_*``,
    ``SBATCH_*`` and ``SALLOC_*`` variables (they describe this allocation, and sbatch reads some of them as
    its own input), but with ``SLURM_CONF`` (which cluster to talk to)."""
    return {k: v for k, v in environ.items()
            if not k.startswith(("SLURM_", "SLURMD_", "SBATCH_", "SALLOC_")) or k == "SLURM_CONF"}


def spare_batch_script(agent_argv: Sequence[str], *, job_name: str = "phoenix-spare") -> str:
    """The batch script of a replenishment job: ONE agent, started on the node Slurm picked, that names
    itself after that node (SLURMD_NODENAME, else the short hostname) with ``--node``."""
    if not agent_argv:
        raise ValueError("agent argv is empty")
    cmd = " ".join(shlex.quote(a) for a in agent_argv)
    return ("#!/bin/bash\n"
            f"# PHOENIX replenishment job ({job_name}): a new warm spare that joins a running job.\n"
            f'exec {cmd} --node "${{SLURMD_NODENAME:-$(hostname -s)}}"\n')
