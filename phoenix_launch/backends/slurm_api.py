"""The one Slurm call no command-line tool makes: ``slurm_complete_job`` (libslurm, through ctypes).

A job whose batch host was lost stays RUNNING for ever: its batch step cannot end, and no ``scontrol`` or
``scancel`` call ends it with an exit code (``scancel`` leaves it CANCELLED). The standby supervisor that took
such a job over ends it as ``salloc`` ends its own allocations, with ``slurm_complete_job(job_id, status)``:
the job is then COMPLETED (status 0) or FAILED with ``ExitCode=<code>:0``, as if the batch script had exited
with the supervisor's code (Slurm 22.05; the test cluster: slurm/cluster/up.sh).

The library is ``libslurm.so`` where the site installs it, else the private ``libslurmfull.so`` the Slurm
commands themselves load (Debian's ``slurm-client``); it is loaded with ``RTLD_GLOBAL`` because its plugins
(auth/munge) resolve symbols from it. Without either, :func:`complete_job` says why and the caller falls back to
``scancel``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re
import shutil
import subprocess
from pathlib import Path

from phoenix_runtime.errors import BackendError


class SlurmApiError(BackendError, RuntimeError):
    pass


def _candidates() -> list[str]:
    found = []
    name = ctypes.util.find_library("slurm")
    if name:
        found.append(name)
    scontrol = shutil.which("scontrol")
    if scontrol:  # the library the commands themselves use (ldd: "libslurmfull.so => /path (0x...)")
        try:
            out = subprocess.run(["ldd", scontrol], capture_output=True, text=True, timeout=5).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        found += re.findall(r"=>\s*(\S*libslurm\S*\.so\S*)", out)
    found += [str(p) for p in Path("/usr/lib").glob("*/slurm-wlm/libslurmfull.so")]  # Debian, any architecture
    return found


def _library() -> ctypes.CDLL:
    errors = []
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            lib.slurm_complete_job  # noqa: B018 -- present in every libslurm since 2.x
            return lib
        except (OSError, AttributeError) as e:
            errors.append(f"{path}: {e}")
    raise SlurmApiError("no libslurm found" + (f" ({'; '.join(errors)})" if errors else ""))


def complete_job(job_id: str, exit_code: int) -> None:
    """End job ``job_id`` as if its batch script had exited with ``exit_code``; SlurmApiError when it cannot."""
    lib = _library()
    if hasattr(lib, "slurm_init"):
        lib.slurm_init(None)  # reads SLURM_CONF (22.05+); older libraries read it lazily
    lib.slurm_complete_job.argtypes = [ctypes.c_uint32, ctypes.c_uint32]
    lib.slurm_complete_job.restype = ctypes.c_int
    status = (int(exit_code) & 0xFF) << 8  # a wait status, as salloc passes its command's
    if lib.slurm_complete_job(int(str(job_id).split("_")[0]), status) != 0:
        lib.slurm_get_errno.restype = ctypes.c_int
        lib.slurm_strerror.restype = ctypes.c_char_p
        errno = lib.slurm_get_errno()
        raise SlurmApiError(f"slurm_complete_job({job_id}): {lib.slurm_strerror(errno).decode(errors='replace')}")
