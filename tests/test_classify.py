"""The failure classifier (phoenix_launch.decide.classify) and the node-health probes (phoenix_launch.detect.health).

The table test feeds real error strings of torch, gloo, NCCL, CUDA and the Linux kernel, each with
where it was seen, through ``classify`` as a one-rank incident on a healthy two-node job.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from datetime import timedelta

import psutil
import pytest

from phoenix_launch.decide.classify import (
    PATTERNS,
    XID_CLASS,
    Action,
    FailureClass,
    RankReport,
    Signals,
    classify,
    describe_exit,
    effective_signal,
    match_text,
    root_cause,
    slurm_state_bad,
    xid_codes,
)
from phoenix_launch.detect.health import (
    GpuEcc,
    assess,
    parse_nvidia_smi_ecc,
    parse_nvidia_smi_query,
    parse_scontrol_node,
    parse_scontrol_nodes,
    parse_xid_lines,
    probe_gpus,
    probe_kernel_xids,
    probe_local,
    probe_node,
    probe_slurm_node,
    xid_codes_since,
)

C = FailureClass
TC, GM, HO, NS, SW, UN = (C.TRANSIENT_COMM, C.GPU_MEMORY, C.HOST, C.NETWORK_STORAGE, C.SOFTWARE,
                          C.UNKNOWN)


@dataclass(frozen=True)
class Row:
    where: str  # "error": the rank's error file ("Type: message"); "log": its log tail only
    text: str
    cls: FailureClass


# Sources: a GitHub thread is named owner/repo#number; a source file by its repository and path.
# Only build paths, host names and addresses are trimmed.
TABLE: dict[str, Row] = {
    # ---- gloo -------------------------------------------------------------------------------
    # RVC-Project/Retrieval-based-Voice-Conversion-WebUI#1882 (title)
    "gloo-closed": Row("error", "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
                       "Connection closed by peer [127.0.0.1]:10895", TC),
    # /work/shared/design/FACTS.md: what the peers of a SIGKILLed rank raise here (torch 2.13, gloo)
    "gloo-closed-facts": Row("error", "RuntimeError: [.../gloo/transport/tcp/pair.cc:553] "
                             "Connection closed by peer [...]", TC),
    # RVC-Project/Retrieval-based-Voice-Conversion-WebUI#1882 (comment, 2024-04-10)
    "gloo-reset": Row("error", "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:589] "
                      "Read error [192.168.70.92]:25266: Connection reset by peer", TC),
    # pytorch/gloo#511 ("Current behavior"); the message is built in gloo/transport/tcp/unbound_buffer.cc
    "gloo-timeout": Row("error", "RuntimeError: [gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
                        "waiting 1800000ms for recv operation to complete", TC),
    # observed here (tests/test_detect.py, torch 2.13): a rank whose gloo process groups were aborted under a
    # pending collective (kill-node --mode comm) raises this; the message is built in gloo/transport/tcp/pair.cc
    "gloo-pair-closure": Row("error", "RuntimeError: Application timeout caused pair closure", TC),
    # ---- NCCL through c10d ------------------------------------------------------------------
    # NVIDIA/nccl#934 (comment, 2023-11-20)
    "nccl-remote": Row("error", "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/"
                       "distributed/c10d/ProcessGroupNCCL.cpp:1347, remote process exited or there "
                       "was a network error, NCCL version 2.18.5\nncclRemoteError: A call failed "
                       "possibly due to a network error or a remote process exiting prematurely.", TC),
    # NVIDIA/nccl#2076 (description; the peer address is trimmed in the source)
    "nccl-remote-reset": Row("error", "torch.distributed.DistBackendError: NCCL error in: /pytorch/"
                             "torch/csrc/distributed/c10d/NCCLUtils.hpp:268, remote process exited or "
                             "there was a network error, NCCL version 2.21.5\nncclRemoteError: A call "
                             "failed possibly due to a network error or a remote process exiting "
                             "prematurely.\nLast error:\nsocketProgressOpt: Call to recv from "
                             "172....<33759> failed : Connection reset by peer", TC),
    # deepseek-ai/DeepEP#106 (turn 6)
    "nccl-ib-completion": Row("log", "with exception: NCCL error: remote process exited or there was "
                              "a network error, NCCL version 2.20.5  ncclRemoteError: A call failed "
                              "possibly due to a network error or a remote process exiting prematurely."
                              "  Last error:  NET/IB : Got completion from peer 172.21.17.89<38536> "
                              "with error 5, opcode 48, len 32710, vendor err 249", TC),
    # hiyouga/LlamaFactory#7396 (description)
    "nccl-watchdog": Row("log", "[rank0]:[E321 02:07:08.408271257 ProcessGroupNCCL.cpp:607] [Rank 0] "
                         "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1580, "
                         "OpType=ALLREDUCE, NumelIn=466119168, NumelOut=466119168, "
                         "Timeout(ms)=600000) ran for 600060 milliseconds before timing out.", TC),
    # pytorch/pytorch#64241 (description: the message after the change)
    "nccl-aborted": Row("error", "RuntimeError: NCCL communicator was aborted on rank 1. Original "
                        "reason for failure was: Work: WorkNCCL(OpType=ALLREDUCE, TensorShape=[1], "
                        "Timeout(ms)=2000) timed out in call to wait().", TC),
    # this repository, runtime/protection/snapshot.py (``wait_timeout``: PHOENIX's own DeviceStall, a D2H copy behind a
    # collective stuck on the GPU)
    "device-stall": Row("error", "DeviceStall: D2H snapshot of step 8: the device did not reach it within 60 s (started "
                        "61 s ago; newest committed step: 7): its stream is stuck behind earlier device work (a "
                        "collective waiting on a peer)", TC),
    # pytorch/pytorch#149984 (description)
    "nccl-system": Row("log", "Collective WorkNCCL(SeqNum=2, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, "
                       "Timeout(ms)=1000000) raised the following async exception: NCCL error: "
                       "unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version "
                       "2.25.1\nncclSystemError: System call (e.g. socket, malloc) or external library "
                       "call failed or device error.", TC),
    # NVIDIA/nccl#795 (description; the host name is trimmed)
    "nccl-socket-closed": Row("log", "a100-st-p4d24xlarge-22:183006:183181 [1] misc/socket.cc:538 "
                              "NCCL WARN Net : Connection closed by remote peer a100-st-p4d24xlarge-22"
                              "<47861>", TC),
    # vllm-project/vllm#18492 (a torch C++ warning line is all the rank left)
    "tcpstore-reset": Row("log", "[rank1]:[W520 21:12:22.801158701 TCPStore.cpp:115] [c10d] "
                          "recvVector failed on SocketImpl(fd=24, addr=[...]:32772, remote=[...]:49587):"
                          " Connection reset by peer", TC),
    # Dere-Wah/AI-MarioKart64#3
    "tcpstore-0-bytes": Row("log", "[rank2]:[W625 23:35:35.303797152 TCPStore.cpp:125] [c10d] "
                            "recvValue failed on SocketImpl(fd=6, addr=[::ffff:127.0.0.1]:37468, "
                            "remote=[::ffff:127.0.0.1]:6006): failed to recv, got 0 bytes", TC),
    # CPython's socket error when the peer's port is gone (a rank's store or p2p peer died)
    "conn-refused": Row("error", "ConnectionRefusedError: [Errno 111] Connection refused", TC),
    # ---- GPU memory -------------------------------------------------------------------------
    # zai-org/ChatGLM3#681 (description), also vllm-project/vllm#5222
    "cuda-ecc": Row("error", "RuntimeError: CUDA error: uncorrectable ECC error encountered\nCUDA "
                    "kernel errors might be asynchronously reported at some other API call, so the "
                    "stacktrace below might be incorrect.\nFor debugging consider passing "
                    "CUDA_LAUNCH_BLOCKING=1.\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side "
                    "assertions.", GM),
    # NVIDIA/semantic-segmentation#33 (older torch)
    "cuda-ecc-39": Row("error", "RuntimeError: cuda runtime error (39) : uncorrectable ECC error "
                       "encountered at /pytorch/aten/src/THC/THCCachingHostAllocator.cpp:265", GM),
    # nagadit/DeepFaceLab_Linux#89 (TensorFlow, driver API name)
    "cuda-driver-ecc": Row("log", "Internal: failed call to cuDevicePrimaryCtxRetain: "
                           "CUDA_ERROR_ECC_UNCORRECTABLE: uncorrectable ECC error encountered", GM),
    # NVIDIA/gpu-operator#1146, as quoted in a public Xid signature table
    "xid-48": Row("log", "NVRM: Xid (PCI:0000:07:00): 48, pid='<unknown>', name=<unknown>, An "
                  "uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer "
                  "at physAddr 0x7fdf0de80 partition 5, subpartition 1", GM),
    # stas00/ml-engineering, debug/nccl-performance-debug / "Xid Errors"
    "xid-63": Row("log", "NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New row marked for "
                  "remapping, reset gpu to activate.", GM),
    # plexus.company/guides/gpu-xid-errors/64 ("Typical kernel-log signature")
    "xid-64": Row("log", "NVRM: Xid (PCI:0000:65:00): 64, pid='N/A', Row Remapper: Failed to remap "
                  "row", GM),
    # NVIDIA/open-gpu-kernel-modules, src/nvidia/src/kernel/gpu/arch/ampere (_gpuGenerateErrorLog)
    "xid-94-mig": Row("log", "NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=7194, Contained: CE User "
                      "Channel (0x9). RST: No, D-RST: No", GM),
    # same source
    "xid-95": Row("log", "NVRM: Xid (PCI:0000:01:00): 95, pid=7062, Uncontained: LTC TAG (0x2, 0x1)."
                  " RST: Yes, D-RST: No", GM),
    # ---- PCIe / host / kernel ---------------------------------------------------------------
    # NVIDIA/NVSentinel#155 (comment)
    "xid-79": Row("log", "NVRM: Xid (PCI:0000:44:00): 79, GPU has fallen off the bus", HO),
    # a syslog excerpt in a public bug report (kernel timestamp and host kept)
    "xid-79-syslog": Row("log", "Jan 16 14:04:39 pyrite kernel: [44643.002804] NVRM: Xid "
                         "(PCI:0000:05:00): 79, pid=1173, GPU has fallen off the bus.", HO),
    # NVIDIA/NVSentinel#155 (description): newer drivers, no Xid line
    "fallen-off-no-xid": Row("log", "[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0\n"
                             "               NVRM: (PCI ID: 10de:26b5) installed in this system has\n"
                             "               NVRM: fallen off the bus and is not responding to "
                             "commands.", HO),
    # nvidia-smi on a node whose GPU fell off the bus (a cluster's admin notes, lince2 nodes)
    "nvidia-smi-gpu-lost": Row("log", "Unable to determine the device handle for GPU 0000:05:00.0: "
                               "GPU is lost.  Reboot the system to recover this GPU", HO),
    # Linux kernel oops (kernel mailing-list report)
    "kernel-panic": Row("log", "[   50.795527][ T7972] Kernel panic - not syncing: Fatal exception", HO),
    # ovro-lwa/lwa-issues#117 (dmesg)
    "mce": Row("log", "[11219.196673] mce: [Hardware Error]: Machine check events logged", HO),
    # ovro-lwa/lwa-issues#117 (dmesg)
    "edac-ue": Row("log", "[11189.970968] EDAC MC3: 1 UE memory read error on "
                   "CPU_SrcID#1_MC#1_Chan#2_DIMM#0 (channel:2 slot:0 page:0xb757589 offset:0x140 "
                   "grain:32 -  OVERFLOW err_code:0101:0092 socket:1 imc:1 rank:0 bg:3 ba:0 "
                   "row:1a1e8 col:180)", HO),
    # ---- network / storage on the node ------------------------------------------------------
    # Linux e1000e driver, as logged (dmesg in a public kernel thread)
    "nic-down": Row("log", "[   21.909038] e1000e 0000:00:1f.6 eth0: NIC Link is Down", NS),
    # Linux block layer, nvme removal (public kernel mailing-list report)
    "blk-io-error": Row("log", "blk_update_request: I/O error, dev nvme0n1, sector 32776 op "
                        "0x1:(WRITE) flags 0x3000 phys_seg 6 prio class 0", NS),
    # ext4 after a journal abort (syslog, as quoted in a public "Read-only file system" note)
    "ext4-abort": Row("log", "kernel: EXT4-fs error (device sda1): ext4_journal_check_start:83: comm "
                      "kworker: Detected aborted journal\nkernel: EXT4-fs (sda1): Remounting "
                      "filesystem read-only", NS),
    # pytorch/pytorch#10577 (comment: torch.save on a failing disk)
    "torch-save-eio": Row("error", "RuntimeError: write(): fd 29 failed with Input/output error", NS),
    # YuanGongND/ast#30 (torch.save on a full disk)
    "enospc": Row("error", "OSError: [Errno 28] No space left on device", NS),
    # CPython's OSError for ENETUNREACH (strerror of errno 101 on Linux)
    "enetunreach": Row("error", "OSError: [Errno 101] Network is unreachable", NS),
    # ---- software / numerical ---------------------------------------------------------------
    # pytorch/pytorch#16417 (comment, 2024-03-13)
    "cuda-oom": Row("error", "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 22.00 "
                    "MiB. GPU 0 has a total capacity of 23.65 GiB of which 11.06 MiB is free. Including"
                    " non-PyTorch memory, this process has 23.60 GiB memory in use. Of the allocated "
                    "memory 22.90 GiB is allocated by PyTorch, and 194.87 MiB is reserved by PyTorch "
                    "but unallocated.", SW),
    # pytorch/pytorch#16417 (title, older torch)
    "cuda-oom-old": Row("error", "RuntimeError: CUDA out of memory. Tried to allocate 12.50 MiB (GPU 0;"
                        " 10.92 GiB total capacity; 8.57 MiB already allocated; 9.28 GiB free; 4.68 MiB"
                        " cached)", SW),
    # lllyasviel/FramePack#369 (title)
    "torch-oom": Row("error", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
                     "29.76 GiB", SW),
    # facebookresearch/detectron2, detectron2/engine/train_loop.py (_detect_anomaly)
    "nan-detectron2": Row("error", "FloatingPointError: Loss became infinite or NaN at "
                          "iteration=1234!\nloss_dict = {'loss_cls': nan}", SW),
    # torch.autograd.detect_anomaly, as reported in a public note (LogSoftmaxBackward0)
    "nan-anomaly": Row("error", "RuntimeError: Function 'LogSoftmaxBackward0' returned nan values in "
                       "its 0th output.", SW),
    # facebookresearch/detr, engine.py: print("Loss is {}, stopping training".format(loss_value))
    "nan-detr": Row("log", "Loss is nan, stopping training\n{'loss_ce': nan}", SW),
    # CPython's import system
    "module-not-found": Row("error", "ModuleNotFoundError: No module named 'flash_attn'", SW),
    # CPython's parser
    "syntax-error": Row("error", "SyntaxError: invalid syntax", SW),
    # the markupsafe 2.1 break (jinja2 < 3.0), a widely reported ImportError
    "import-error": Row("error", "ImportError: cannot import name 'soft_unicode' from 'markupsafe'", SW),
    # a common torch message (skill docs, many issues)
    "device-assert": Row("error", "RuntimeError: CUDA error: device-side assert triggered", SW),
    # VITA-Group/TEGNAS#19
    "illegal-memory": Row("error", "RuntimeError: CUDA error: an illegal memory access was "
                          "encountered\nCUDA kernel errors might be asynchronously reported at some "
                          "other API call,so the stacktrace below might be incorrect.", SW),
    # torch DataLoader on a container with a small /dev/shm ("Bus error" is not the PCIe bus)
    "dataloader-shm": Row("error", "RuntimeError: DataLoader worker (pid 229) is killed by signal: "
                          "Bus error. It is possible that dataloader's workers are out of shared "
                          "memory. Please try to raise your shared memory limit.", SW),
    # Linux OOM killer (dmesg)
    "host-oom": Row("log", "[Tue Sep 16 03:14:22] Out of memory: Killed process 2481 (python3) "
                    "total-vm:8123400kB, anon-rss:7981200kB, file-rss:0kB, oom_score_adj:0", SW),
    # ---- unknown: stop with the root cause (or the fallback) --------------------------------
    # torch nll_loss's shape check
    "shape-mismatch": Row("error", "ValueError: Expected input batch_size (32) to match target "
                          "batch_size (16).", UN),
    # torch.load of a truncated checkpoint
    "corrupt-checkpoint": Row("error", "RuntimeError: PytorchStreamReader failed reading zip archive: "
                              "failed finding central directory", UN),
}


def _error(text: str) -> dict:
    m = re.match(r"^((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*): (.*)$", text, re.DOTALL)
    etype, msg = (m.group(1), m.group(2)) if m else ("RuntimeError", text)
    return {"type": etype, "message": msg, "traceback": "", "step": 7}


def _one_rank(row: Row, exit_code: int | None = 1) -> Signals:
    if row.where == "error":
        rep = RankReport("n1", 0, exit_code, None, _error(row.text), log_tail="step 7 done\n", time=1.0)
    else:
        rep = RankReport("n1", 0, exit_code, None, None, log_tail="step 7 done\n" + row.text, time=1.0)
    return Signals(reports=(rep,), healthy_nodes=frozenset({"n1", "n2"}), world_ranks=2)


def test_table_is_big_enough():
    assert len(TABLE) >= 30
    # no text says "exited"; a straggler is found by its pace, not by a text (test_pure)
    assert {r.cls for r in TABLE.values()} == set(FailureClass) - {FailureClass.PROCESS_EXIT, FailureClass.STRAGGLER}


@pytest.mark.parametrize("key", list(TABLE))
def test_table(key):
    row = TABLE[key]
    if row.cls is TC:  # a live rank reports a comm error; the same text from a rank that exited is not transient
        assert classify(_one_rank(row)).cls is C.PROCESS_EXIT
    v = classify(_one_rank(row, exit_code=None if row.cls is TC else 1))
    assert v.cls is row.cls, v.reason
    expected_action = {TC: Action.LOCAL_RECOVERY, GM: Action.REPLACE_NODE, HO: Action.REPLACE_NODE,
                       NS: Action.REPLACE_NODE, SW: Action.STOP, UN: Action.STOP}[row.cls]
    assert v.action is expected_action, v.reason
    assert v.node == ("n1" if expected_action is not Action.STOP else None)
    assert v.root is not None and v.root.node == "n1"
    assert "\n" not in v.reason and v.reason


def test_every_pattern_row_matches_a_real_string():
    """No row of the pattern table is there on faith: each one matches a string of the table."""
    names = [p.name for p in PATTERNS]
    assert len(names) == len(set(names))
    hit = {p.name for p in PATTERNS for r in TABLE.values() if p.regex.search(r.text)}
    assert hit == set(names)
    # and the table's strongest match agrees with the class it expects
    for key, row in TABLE.items():
        m = match_text(row.text)
        assert (m.cls if m else UN) is row.cls, key


# --------------------------------------------------------------------------------------------
# Rules
# --------------------------------------------------------------------------------------------

CLOSED = "RuntimeError: [.../gloo/transport/tcp/pair.cc:553] Connection closed by peer [...]"


def rep(node, rank, *, exit_code=1, sig=None, error=None, log="", t=0.0, step=5):
    err = None
    if error is not None:
        err = _error(error)
        err["step"] = step
    return RankReport(node, rank, exit_code, sig, err, log_tail=log, time=t)


def test_peer_comm_error_is_a_consequence_of_the_killed_rank():
    """FACTS.md: SIGKILL one rank and its peers' gloo calls fail with 'Connection closed by peer'.
    The killed rank is the root, even when a peer's error was stamped earlier."""
    s = Signals(
        reports=(
            rep("n1", 0, error=CLOSED, t=10.00),
            rep("n1", 1, error=CLOSED, t=10.01),
            rep("n2", 2, exit_code=-9, t=10.05),
            rep("n2", 3, error=CLOSED, t=10.02),
        ),
        healthy_nodes=frozenset({"n1", "n2"}),
        world_ranks=4,
    )
    v = classify(s)
    assert (v.cls, v.action, v.node) == (HO, Action.REPLACE_NODE, "n2")
    assert v.root is s.reports[2]
    assert "SIGKILL" in v.reason and "passes the health probe" in v.reason
    assert "consequences" in v.reason


def test_sigkill_on_a_node_that_fails_its_probe_says_so():
    s = Signals(reports=(rep("n2", 1, exit_code=None, sig=signal.SIGKILL),),
                healthy_nodes=frozenset({"n1"}), world_ranks=2)
    v = classify(s)
    assert (v.cls, v.action, v.node) == (HO, Action.REPLACE_NODE, "n2")
    assert "did not pass the health probe" in v.reason


def test_sigkill_on_every_node_is_an_outside_kill():
    s = Signals(reports=(rep("n1", 0, exit_code=-9, t=1.0), rep("n2", 1, exit_code=-9, t=1.0)),
                healthy_nodes=frozenset({"n1", "n2"}), world_ranks=2)
    v = classify(s)
    assert (v.cls, v.action, v.node) == (UN, Action.STOP, None)
    assert "from outside" in v.reason


def test_shell_status_137_is_sigkill():
    s = Signals(reports=(rep("n2", 1, exit_code=137),), healthy_nodes=frozenset({"n1", "n2"}))
    assert classify(s).cls is HO


def test_comm_error_with_every_node_healthy_is_local_recovery():
    """Live ranks reporting comm errors (``rank_error``: no exit status) on healthy nodes: transient."""
    s = Signals(reports=(rep("n2", 3, exit_code=None, error=TABLE["gloo-reset"].text, t=2.0),
                         rep("n1", 0, exit_code=None, error=TABLE["gloo-timeout"].text, t=3.0)),
                healthy_nodes=frozenset({"n1", "n2"}), world_ranks=4)
    v = classify(s)
    assert (v.cls, v.action, v.node) == (TC, Action.LOCAL_RECOVERY, "n2")
    assert v.root is s.reports[0] and v.exited == ()


@pytest.mark.parametrize("exit_code, sig", [(1, None), (None, signal.SIGTERM), (-15, None)])
def test_a_rank_that_exited_is_never_transient_whatever_its_message(exit_code, sig):
    """Issue 12: a rank exits with 'Connection reset by peer' while its peers report comm errors alive: its
    process is gone, so the verdict is PROCESS_EXIT (local recovery that respawns it), never transient."""
    s = Signals(reports=(rep("n1", 0, exit_code=None, error=CLOSED, t=1.0),
                         rep("n2", 3, exit_code=exit_code, sig=sig, error=TABLE["gloo-reset"].text, t=2.0)),
                healthy_nodes=frozenset({"n1", "n2"}), world_ranks=4)
    v = classify(s)
    assert (v.cls, v.action, v.node) == (C.PROCESS_EXIT, Action.LOCAL_RECOVERY, "n2")
    assert v.exited == (3,) and "not transient" in v.reason and v.root is s.reports[1]


def test_comm_error_on_a_node_that_fails_its_probe_replaces_it():
    s = Signals(reports=(rep("n1", 0, error=CLOSED, t=1.0), rep("n2", 2, error=CLOSED, t=2.0)),
                healthy_nodes=frozenset({"n1", "n3"}), world_ranks=4)
    v = classify(s)
    assert (v.cls, v.action, v.node) == (NS, Action.REPLACE_NODE, "n2")


def test_comm_error_without_any_probe_is_unknown_and_uses_the_fallback():
    s = Signals(reports=(rep("n1", 0, error=CLOSED),), world_ranks=2)
    v = classify(s)
    assert (v.cls, v.action, v.node) == (UN, Action.STOP, None)
    v = classify(s, fallback=Action.REPLACE_NODE)
    assert (v.cls, v.action, v.node) == (UN, Action.REPLACE_NODE, "n1")


def test_hardware_evidence_outranks_the_exception_text():
    """Every rank raises the same ValueError, but n2's kernel logged Xid 79: the node goes."""
    reports = tuple(rep(f"n{r // 2 + 1}", r, error=f"ValueError: bad batch at step {r}", t=r)
                    for r in range(4))
    s = Signals(reports=reports, xid={"n2": (79,)}, healthy_nodes=frozenset({"n1"}), world_ranks=4)
    v = classify(s)
    assert (v.cls, v.action, v.node) == (HO, Action.REPLACE_NODE, "n2")
    assert "Xid 79" in v.reason and "fallen off the bus" in v.reason
    assert v.root is reports[2]


@pytest.mark.parametrize(
    "evidence, cls",
    [
        ({"xid": {"n2": (48,)}}, GM),
        ({"xid": {"n2": (13, 94)}}, GM),  # 13 is the application's; 94 is memory
        ({"xid": {"n2": (63, 79)}}, HO),  # the GPU fell off the bus: the stronger finding
        ({"ecc_uncorrected": {"n2": 2, "n1": 0}}, GM),
        ({"slurm_state": {"n2": "DOWN*", "n1": "ALLOCATED"}}, HO),
        ({"slurm_state": {"n2": "MIXED+DRAIN"}}, HO),
        ({"node_lost": ("n2",)}, HO),
    ],
)
def test_probe_evidence(evidence, cls):
    s = Signals(reports=(rep("n1", 0, error=CLOSED),), healthy_nodes=frozenset({"n1"}),
                world_ranks=2, **evidence)
    v = classify(s)
    assert (v.cls, v.action, v.node) == (cls, Action.REPLACE_NODE, "n2")


def test_application_xids_are_not_hardware_evidence():
    s = Signals(reports=(rep("n1", 0, error=TABLE["illegal-memory"].text),),
                xid={"n1": (13, 31)}, healthy_nodes=frozenset({"n1", "n2"}), world_ranks=2)
    assert classify(s).cls is SW


def test_same_exception_on_nearly_every_rank_is_software():
    reports = tuple(
        rep(f"n{r % 4}", r, error=f"KeyError: 'rank{r}_layer.weight' at offset 0x{r:x}", t=float(r))
        for r in range(7)
    )
    s = Signals(reports=reports, healthy_nodes=frozenset({"n0", "n1", "n2", "n3"}), world_ranks=8)
    v = classify(s)
    assert (v.cls, v.action, v.node) == (SW, Action.STOP, None)
    assert "7 of 8 ranks" in v.reason
    assert v.root is reports[0]


def test_same_exception_on_a_few_ranks_is_not_called_software():
    reports = (rep("n0", 0, error="ValueError: x"), rep("n1", 1, error="ValueError: x"))
    s = Signals(reports=reports, healthy_nodes=frozenset({"n0", "n1"}), world_ranks=8)
    assert classify(s).cls is UN


def test_comm_errors_everywhere_are_not_a_software_bug():
    """Seven ranks echo 'Connection closed by peer'; the eighth died silently on n3."""
    reports = tuple(rep(f"n{r // 2}", r, error=CLOSED, t=1.0) for r in range(7))
    s = Signals(reports=reports + (rep("n3", 7, exit_code=-9, t=1.5),),
                healthy_nodes=frozenset({"n0", "n1", "n2", "n3"}), world_ranks=8)
    v = classify(s)
    assert (v.cls, v.node) == (HO, "n3")


def test_crash_signal_on_every_rank_is_software():
    reports = tuple(rep(f"n{r}", r, exit_code=-int(signal.SIGSEGV)) for r in range(4))
    s = Signals(reports=reports, healthy_nodes=frozenset({"n0", "n1", "n2", "n3"}), world_ranks=4)
    v = classify(s)
    assert (v.cls, v.action) == (SW, Action.STOP)
    assert "SIGSEGV" in v.reason


def test_error_raised_at_import_is_software():
    tb = ('Traceback (most recent call last):\n  File "train.py", line 3, in <module>\n'
          '    import mymodel\n  File "/job/mymodel.py", line 10, in <module>\n'
          '    WIDTH = CONFIG["width"]\nNameError: name \'CONFIG\' is not defined\n')
    err = {"type": "NameError", "message": "name 'CONFIG' is not defined", "traceback": tb,
           "step": None}
    s = Signals(reports=(RankReport("n1", 0, 1, None, err),),
                healthy_nodes=frozenset({"n1", "n2"}), world_ranks=2)
    v = classify(s)
    assert (v.cls, v.action) == (SW, Action.STOP)
    assert "import" in v.reason


def test_a_software_error_on_one_rank_stops_and_peers_are_echoes():
    s = Signals(reports=(rep("n1", 0, error=CLOSED, t=1.0),
                         rep("n2", 1, error=TABLE["cuda-oom"].text, t=1.1)),
                healthy_nodes=frozenset({"n1", "n2"}), world_ranks=2)
    v = classify(s)
    assert (v.cls, v.action, v.node) == (SW, Action.STOP, None)
    assert v.root is s.reports[1]
    assert "cuda-oom" in v.reason


def test_hardware_text_beats_an_earlier_software_error():
    s = Signals(reports=(rep("n1", 0, error="ValueError: odd", t=1.0),
                         rep("n2", 1, error=TABLE["cuda-ecc"].text, t=2.0)),
                healthy_nodes=frozenset({"n1", "n2"}), world_ranks=4)
    v = classify(s)
    assert (v.cls, v.node) == (GM, "n2")


def test_kernel_grade_line_in_the_log_outranks_the_error_file():
    s = Signals(reports=(rep("n1", 0, error=TABLE["nccl-remote"].text,
                             log="...\n" + TABLE["xid-95"].text + "\n"),),
                healthy_nodes=frozenset({"n1", "n2"}), world_ranks=2)
    assert classify(s).cls is GM


def test_errno_strings_in_an_old_log_do_not_override_the_error_file():
    s = Signals(reports=(rep("n1", 0, error="ValueError: shapes (3,) and (4,) not aligned",
                             log="OSError: [Errno 28] No space left on device (retried, ok)\n"),),
                healthy_nodes=frozenset({"n1", "n2"}), world_ranks=2)
    assert classify(s).cls is UN


def test_torch_startup_warning_does_not_blame_the_network():
    """This warning is printed at a healthy start (the run then trains normally)."""
    warning = ("[W socket.cpp:663] [c10d] The client socket has failed to connect to "
               "[localhost]:12345 (errno: 101 - Network is unreachable).")
    s = Signals(reports=(rep("n1", 0, exit_code=-9, log=warning + "\nGPU:0 | Epoch: 1\n"),),
                healthy_nodes=frozenset({"n1", "n2"}), world_ranks=2)
    v = classify(s)
    assert (v.cls, v.node) == (HO, "n1")
    assert "SIGKILL" in v.reason


def test_storage_failure_on_every_node_is_shared_and_stops():
    s = Signals(reports=(rep("n1", 0, error=TABLE["enospc"].text, t=1.0),
                         rep("n2", 1, error=TABLE["enospc"].text, t=1.2)),
                healthy_nodes=frozenset({"n1", "n2"}), world_ranks=8)
    v = classify(s)
    assert (v.cls, v.action, v.node) == (NS, Action.STOP, None)
    assert "every node" in v.reason


def test_storage_failure_on_one_node_replaces_it():
    s = Signals(reports=(rep("n2", 1, error=TABLE["enospc"].text, t=1.0),
                         rep("n1", 0, error=CLOSED, t=1.2)),
                healthy_nodes=frozenset({"n1", "n2"}), world_ranks=8)
    v = classify(s)
    assert (v.cls, v.action, v.node) == (NS, Action.REPLACE_NODE, "n2")


def test_hung_node_is_replaced_and_peers_timeouts_are_consequences():
    s = Signals(reports=(rep("n1", 0, error=TABLE["gloo-timeout"].text),), hung=("n2",),
                healthy_nodes=frozenset({"n1"}), world_ranks=4)
    v = classify(s)
    assert (v.cls, v.action, v.node) == (HO, Action.REPLACE_NODE, "n2")
    assert "heartbeat" in v.reason


def test_every_node_hung_is_a_job_wide_hang():
    s = Signals(reports=(), hung=("n1", "n2"), healthy_nodes=frozenset({"n1", "n2"}))
    v = classify(s)
    assert (v.cls, v.action, v.node) == (UN, Action.STOP, None)
    assert "job-wide" in v.reason


def test_unknown_exception_uses_the_fallback():
    s = _one_rank(TABLE["shape-mismatch"])
    assert classify(s).action is Action.STOP
    v = classify(s, fallback=Action.REPLACE_NODE)
    assert (v.cls, v.action, v.node) == (UN, Action.REPLACE_NODE, "n1")
    v = classify(s, fallback=Action.LOCAL_RECOVERY)
    assert (v.action, v.node) == (Action.LOCAL_RECOVERY, "n1")


def test_software_never_restarts_whatever_the_fallback():
    v = classify(_one_rank(TABLE["module-not-found"]), fallback=Action.REPLACE_NODE)
    assert (v.cls, v.action) == (SW, Action.STOP)


def test_nothing_known_is_unknown():
    v = classify(Signals(reports=()))
    assert (v.cls, v.action, v.node, v.root) == (UN, Action.STOP, None, None)
    v = classify(Signals(reports=()), fallback=Action.REPLACE_NODE)
    assert v.action is Action.STOP and "no node" in v.reason


# The evidence each injection mode leaves (as observed in a real job; the injection itself never marks
# the class: the verdict comes from the same rules as for a real failure).
PEER_CLOSED = rep("n1", 0, exit_code=None, error=CLOSED, t=1.2)  # a live peer's rank_error
INJECTION_EVIDENCE = {
    "crash": dict(reports=(PEER_CLOSED,), node_lost=("n2",)),
    "rank": dict(reports=(PEER_CLOSED, rep("n2", 2, exit_code=None, sig=signal.SIGKILL, t=1.0))),
    "hang": dict(reports=(PEER_CLOSED,), hung=("n2",)),
    "comm": dict(reports=(rep("n2", 2, exit_code=None, t=1.0, error="RuntimeError: Application timeout caused pair closure"),
                          PEER_CLOSED)),
    "gpu-ecc": dict(reports=(PEER_CLOSED, rep("n2", 2, t=1.0,
                    error="RuntimeError: CUDA error: uncorrectable ECC error encountered (injected by phoenix-run kill-node)"))),
    "pcie": dict(reports=(PEER_CLOSED, rep("n2", 2, t=1.0,
                 error="RuntimeError: CUDA error: unspecified launch failure; NVRM: Xid 79, GPU has fallen off the bus"))),
}


@pytest.mark.parametrize(
    "mode, cls, action",
    [
        ("crash", HO, Action.REPLACE_NODE),
        ("rank", HO, Action.REPLACE_NODE),
        ("hang", HO, Action.REPLACE_NODE),
        ("comm", TC, Action.LOCAL_RECOVERY),
        ("gpu-ecc", GM, Action.REPLACE_NODE),
        ("pcie", HO, Action.REPLACE_NODE),
    ],
)
def test_injected_faults_are_classified_from_their_evidence(mode, cls, action):
    s = Signals(healthy_nodes=frozenset({"n1", "n2"}), world_ranks=4, **INJECTION_EVIDENCE[mode])
    v = classify(s)
    assert (v.cls, v.action, v.node) == (cls, action, "n2")
    assert "inject" not in v.reason.split("(")[0]  # the reason names the evidence, not the injection


def test_signals_have_no_injection_field():
    with pytest.raises(TypeError):
        Signals(reports=(), injected="crash")  # type: ignore[call-arg]


def test_classify_is_pure():
    s = Signals(reports=(rep("n1", 0, error=CLOSED, t=1.0), rep("n2", 1, exit_code=-9, t=2.0)),
                xid={"n3": (63,)}, healthy_nodes=frozenset({"n1", "n2"}), world_ranks=4)
    before = repr(s)
    assert classify(s) == classify(s)
    assert repr(s) == before


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def test_root_cause_is_the_earliest():
    a, b, c = rep("n1", 0, t=3.0), rep("n2", 1, t=1.0), rep("n3", 2, t=1.0)
    assert root_cause([a, b, c]) is b  # ties: the first given
    assert root_cause([]) is None


@pytest.mark.parametrize(
    "exit_code, sig, text",
    [
        (None, 9, "killed by SIGKILL"),
        (-9, None, "killed by SIGKILL"),
        (-15, None, "killed by SIGTERM"),
        (1, None, "exit code 1"),
        (0, None, "exit code 0"),
        (137, None, "exit code 137 (128+SIGKILL)"),
        (None, None, "no exit status"),
        (None, 77, "killed by signal 77"),
    ],
)
def test_describe_exit(exit_code, sig, text):
    assert describe_exit(exit_code, sig) == text


def test_effective_signal():
    assert effective_signal(-9, None) == 9
    assert effective_signal(137, None) == 9
    assert effective_signal(None, 19) == 19
    assert effective_signal(1, None) is None and effective_signal(0, None) is None


@pytest.mark.parametrize(
    "state, bad",
    [("DOWN*", True), ("DOWN", True), ("IDLE+DRAIN", True), ("MIXED+DRAIN", True),
     ("DRAINED", True), ("ALLOCATED*", True), ("DOWN+NOT_RESPONDING", True), ("FAIL", True),
     ("IDLE", False), ("ALLOCATED", False), ("MIXED", False), ("IDLE~", False), ("", False),
     (None, False)],
)
def test_slurm_state_bad(state, bad):
    assert slurm_state_bad(state) is bad


def test_xid_table_has_the_issue_codes():
    for code in (48, 63, 64, 94, 95):
        assert XID_CLASS[code] is GM
    assert XID_CLASS[79] is HO
    assert 13 not in XID_CLASS and 31 not in XID_CLASS
    assert xid_codes(TABLE["xid-94-mig"].text) == (94,)
    assert xid_codes(TABLE["fallen-off-no-xid"].text) == (79,)


# --------------------------------------------------------------------------------------------
# Parsers (pure)
# --------------------------------------------------------------------------------------------

# Kernel log with Xid lines as printed by the NVIDIA driver (lines from the table's sources, plus
# an application Xid 13 in the form leptonai/gpud documents).
DMESG = """\
[  612.001] e1000e 0000:00:1f.6 eth0: NIC Link is Up 1000 Mbps Full Duplex
[  612.440] NVRM: Xid (PCI:0000:07:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at physAddr 0x7fdf0de80 partition 5, subpartition 1
[ 1843.1] NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception on (GPC 7, TPC 7, SM 0): Illegal Instruction Parameter
[ 2001.5] NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=7194, Contained: CE User Channel (0x9). RST: No, D-RST: No
NVRM: Xid (0000:03:00): 14, Channel 00000001
"""


def test_parse_xid_lines():
    ev = parse_xid_lines(DMESG)
    assert [(e.device, e.code, e.uptime) for e in ev] == [
        ("PCI:0000:07:00", 48, 612.44),
        ("PCI:0000:cb:00", 13, 1843.1),
        ("PCI:0000:01:00 GPU-I:05", 94, 2001.5),
        ("0000:03:00", 14, None),
    ]
    assert xid_codes_since(ev, 1000.0) == (13, 94, 14)  # unstamped lines are kept
    assert xid_codes_since(ev, None) == (48, 13, 94, 14)


def test_parse_xid_fallen_off_without_xid_line():
    ev = parse_xid_lines(TABLE["fallen-off-no-xid"].text)
    assert [(e.device, e.code, e.uptime) for e in ev] == [("0000:b3:00.0", 79, 1843.308145)]
    assert parse_xid_lines(TABLE["xid-79-syslog"].text)[0].code == 79
    assert parse_xid_lines("no nvidia here") == []


# `nvidia-smi -q` on an A100 after an Xid 63 (stas00/ml-engineering, "Xid Errors"), as printed.
SMI_A100 = """\
Timestamp                                 : Wed Jun  7 19:32:16 2023
Driver Version                            : 510.73.08
CUDA Version                              : 11.6

Attached GPUs                             : 8
GPU 00000000:10:1C.0
    Product Name                          : NVIDIA A100-SXM4-80GB
    [...]
    ECC Errors
        Volatile
            SRAM Correctable              : 0
            SRAM Uncorrectable            : 0
            DRAM Correctable              : 177
            DRAM Uncorrectable            : 0
        Aggregate
            SRAM Correctable              : 0
            SRAM Uncorrectable            : 0
            DRAM Correctable              : 177
            DRAM Uncorrectable            : 0
    Retired Pages
        Single Bit ECC                    : N/A
        Double Bit ECC                    : N/A
        Pending Page Blacklist            : N/A
    Remapped Rows
        Correctable Error                 : 1
        Uncorrectable Error               : 0
        Pending                           : Yes
        Remapping Failure Occurred        : No
        Bank Remap Availability Histogram
            Max                           : 639 bank(s)
            High                          : 1 bank(s)
"""

# `nvidia-smi -q -d ECC`, Hopper-era layout (R535+): SRAM uncorrectables split in Parity/SEC-DED
# and a per-source breakdown that must not be counted twice. Two GPUs, the second with errors.
SMI_H100 = """\

==============NVSMI LOG==============

Timestamp                                 : Tue Mar  4 10:12:01 2025
Driver Version                            : 550.54.15
CUDA Version                              : 12.4

Attached GPUs                             : 2
GPU 00000000:18:00.0
    Ecc Mode
        Current                           : Enabled
        Pending                           : Enabled
    ECC Errors
        Volatile
            SRAM Correctable              : 0
            SRAM Uncorrectable Parity     : 0
            SRAM Uncorrectable SEC-DED    : 0
            DRAM Correctable              : 0
            DRAM Uncorrectable            : 0
        Aggregate
            SRAM Correctable              : 0
            SRAM Uncorrectable Parity     : 0
            SRAM Uncorrectable SEC-DED    : 0
            DRAM Correctable              : 3
            DRAM Uncorrectable            : 0
            SRAM Threshold Exceeded       : No
        Aggregate Uncorrectable SRAM Sources
            SRAM L2                       : 0
            SRAM SM                       : 0
            SRAM Microcontroller          : 0
            SRAM PCIE                     : 0
            SRAM Other                    : 0

GPU 00000000:2A:00.0
    Ecc Mode
        Current                           : Enabled
        Pending                           : Enabled
    ECC Errors
        Volatile
            SRAM Correctable              : 0
            SRAM Uncorrectable Parity     : 1
            SRAM Uncorrectable SEC-DED    : 0
            DRAM Correctable              : 12
            DRAM Uncorrectable            : 2
        Aggregate
            SRAM Correctable              : 0
            SRAM Uncorrectable Parity     : 1
            SRAM Uncorrectable SEC-DED    : 0
            DRAM Correctable              : 40
            DRAM Uncorrectable            : 5
            SRAM Threshold Exceeded       : No
        Aggregate Uncorrectable SRAM Sources
            SRAM L2                       : 1
            SRAM SM                       : 0
            SRAM Microcontroller          : 0
            SRAM PCIE                     : 0
            SRAM Other                    : 0
"""

# `nvidia-smi -q -d ECC`, the pre-Ampere layout (V100, R418-era drivers): Single/Double Bit sections.
SMI_V100 = """\
Attached GPUs                             : 1
GPU 00000000:00:1E.0
    Ecc Mode
        Current                           : Enabled
        Pending                           : Enabled
    ECC Errors
        Volatile
            Single Bit            
                Device Memory             : 4
                Register File             : 0
                L1 Cache                  : 0
                L2 Cache                  : 0
                Texture Memory            : N/A
                Texture Shared            : N/A
                CBU                       : N/A
                Total                     : 4
            Double Bit            
                Device Memory             : 1
                Register File             : 0
                L1 Cache                  : 0
                L2 Cache                  : 0
                Texture Memory            : N/A
                Texture Shared            : N/A
                CBU                       : 0
                Total                     : 1
        Aggregate
            Single Bit            
                Device Memory             : 9
                Total                     : 9
            Double Bit            
                Device Memory             : 1
                Total                     : 1
    Retired Pages
        Single Bit ECC                    : 0
        Double Bit ECC                    : 1
        Pending Page Blacklist            : Yes
"""


def test_parse_nvidia_smi_ecc_a100():
    (g,) = parse_nvidia_smi_ecc(SMI_A100)
    assert g == GpuEcc(bus_id="00000000:10:1C.0", ecc_mode=None, volatile_corrected=177,
                       volatile_uncorrected=0, aggregate_corrected=177, aggregate_uncorrected=0,
                       remap_pending=True, remap_failure=False, retirement_pending=None)


def test_parse_nvidia_smi_ecc_h100_sums_without_double_counting():
    a, b = parse_nvidia_smi_ecc(SMI_H100)
    assert (a.bus_id, a.ecc_mode, a.volatile_uncorrected, a.aggregate_corrected,
            a.aggregate_uncorrected) == ("00000000:18:00.0", "Enabled", 0, 3, 0)
    assert (b.bus_id, b.volatile_uncorrected, b.volatile_corrected, b.aggregate_uncorrected) == (
        "00000000:2A:00.0", 3, 12, 6)


def test_parse_nvidia_smi_ecc_v100():
    (g,) = parse_nvidia_smi_ecc(SMI_V100)
    assert (g.volatile_corrected, g.volatile_uncorrected, g.aggregate_corrected,
            g.aggregate_uncorrected, g.retirement_pending) == (4, 1, 9, 1, True)


def test_parse_nvidia_smi_ecc_garbage():
    assert parse_nvidia_smi_ecc("") == []
    assert parse_nvidia_smi_ecc("NVIDIA-SMI has failed because it couldn't communicate with the "
                                "NVIDIA driver.") == []


def test_parse_nvidia_smi_query():
    fields = ["index", "pci.bus_id", "ecc.mode.current", "ecc.errors.uncorrected.volatile.total"]
    out = ("0, 00000000:18:00.0, Enabled, 0\n1, 00000000:2A:00.0, Enabled, 2\n"
           "2, 00000000:3B:00.0, [N/A], [N/A]\n")
    rows = parse_nvidia_smi_query(out, fields)
    assert rows[1] == {"index": "1", "pci.bus_id": "00000000:2A:00.0", "ecc.mode.current": "Enabled",
                       "ecc.errors.uncorrected.volatile.total": "2"}
    assert rows[2]["ecc.errors.uncorrected.volatile.total"] is None
    with_header = "index, pci.bus_id, ecc.mode.current, ecc.errors.uncorrected.volatile.total\n" + out
    assert parse_nvidia_smi_query(with_header, fields) == rows


# `scontrol show node wn2`, as captured in a public test fixture (Slurm 20.x).
SCONTROL_DOWN = """\
NodeName=wn2 Arch=x86_64 CoresPerSocket=1
   CPUAlloc=0 CPUTot=1 CPULoad=0.01
   AvailableFeatures=(null)
   ActiveFeatures=(null)
   Gres=(null)
   NodeAddr=wn2 NodeHostName=wn2
   OS=Linux 3.10.0-1127.13.1.el7.x86_64 #1 SMP Tue Jun 23 15:46:38 UTC 2020
   RealMemory=1 AllocMem=0 FreeMem=N/A Sockets=1 Boards=1
   State=DOWN* ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A
   Partitions=debug
   BootTime=2020-09-21T13:57:57 SlurmdStartTime=2020-09-21T14:01:11
   CfgTRES=cpu=1,mem=1M,billing=1
   AllocTRES=
   CapWatts=n/a
   CurrentWatts=0 AveWatts=0
   ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s
   Reason=Not responding [root@2020-09-21T14:31:24]
"""

# `scontrol -o show node`, one node a line (a public OpenStack/Slurm test fixture).
SCONTROL_ONELINE = (
    "NodeName=slurm-compute-2 Arch=x86_64 CoresPerSocket=2 CPUAlloc=4 CPUTot=4 CPULoad=3.50 "
    "AvailableFeatures=(null) ActiveFeatures=(null) Gres=(null) NodeAddr=192.168.95.11 "
    "NodeHostName=slurm-compute-2 OS=Linux RealMemory=8000 AllocMem=8000 FreeMem=2000 Sockets=2 "
    "Boards=1 State=ALLOCATED ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A "
    "Partitions=all,even Reason=none\n"
    "NodeName=slurm-compute-3 Arch=x86_64 CoresPerSocket=2 CPUAlloc=0 CPUTot=4 CPULoad=0.00 "
    "AvailableFeatures=(null) ActiveFeatures=(null) Gres=(null) NodeAddr=192.168.95.12 "
    "NodeHostName=slurm-compute-3 OS=Linux RealMemory=8000 AllocMem=0 FreeMem=7500 Sockets=2 "
    "Boards=1 State=DOWN* ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A "
    "Partitions=all,odd Reason=Not responding\n"
)


def test_parse_scontrol():
    assert parse_scontrol_node(SCONTROL_DOWN) == "DOWN*"
    assert parse_scontrol_nodes(SCONTROL_ONELINE) == {"slurm-compute-2": "ALLOCATED",
                                                      "slurm-compute-3": "DOWN*"}
    drained = SCONTROL_DOWN.replace("State=DOWN*", "State=IDLE+DRAIN")
    assert parse_scontrol_node(drained) == "IDLE+DRAIN" and slurm_state_bad("IDLE+DRAIN")
    assert parse_scontrol_node("Node n9 not found") is None


def test_assess():
    ok = assess("n1", {"alive": [10, 11], "zombie": [12], "stopped": [], "gone": [13]},
                {"ecc_uncorrected": 0, "lost": False}, (13,), "ALLOCATED")
    assert ok.passed, ok.problems  # exited ranks are the incident; Xid 13 is the application's
    bad = assess("n2", {"alive": [10], "zombie": [], "stopped": [11], "gone": []},
                 {"ecc_uncorrected": 3, "lost": True}, (79,), "DOWN*")
    assert not bad.passed and len(bad.problems) == 5


# --------------------------------------------------------------------------------------------
# Probes (I/O): real processes, and fake tools on PATH
# --------------------------------------------------------------------------------------------


def _wait_status(pid: int, want: str, deadline_s: float = 10.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            if psutil.Process(pid).status() == want:
                return
        except psutil.NoSuchProcess:
            if want == "gone":
                return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} never became {want}")


def test_probe_local_real_processes():
    procs = [subprocess.Popen(["sleep", "30"]) for _ in range(4)]
    running, stopped, zombie, reaped = procs
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        _wait_status(stopped.pid, psutil.STATUS_STOPPED)
        os.kill(zombie.pid, signal.SIGKILL)  # not waited for: stays a zombie
        _wait_status(zombie.pid, psutil.STATUS_ZOMBIE)
        reaped.kill()
        reaped.wait(timeout=10)
        res = probe_local([running.pid, stopped.pid, zombie.pid, reaped.pid])
        assert res["pids"] == {running.pid: "alive", stopped.pid: "stopped",
                               zombie.pid: "zombie", reaped.pid: "gone"}
        assert res["stopped"] == [stopped.pid] and res["alive"] == [running.pid]
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=10)


def _tool(dir_, name: str, body: str) -> None:
    path = dir_ / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)


def test_probe_gpus_without_nvidia_smi(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert probe_gpus() is None


def test_probe_gpus_parses_the_tool(tmp_path, monkeypatch):
    (tmp_path / "out.txt").write_text(SMI_H100)
    _tool(tmp_path, "nvidia-smi", f"/bin/cat {tmp_path / 'out.txt'}")
    monkeypatch.setenv("PATH", str(tmp_path))
    res = probe_gpus()
    assert res is not None and res["error"] is None
    assert res["ecc_uncorrected"] == 3 and not res["lost"] and len(res["gpus"]) == 2


def test_probe_gpus_lost_gpu(tmp_path, monkeypatch):
    _tool(tmp_path, "nvidia-smi",
          "echo 'Unable to determine the device handle for GPU0000:3B:00.0: Unknown Error'; exit 15")
    monkeypatch.setenv("PATH", str(tmp_path))
    res = probe_gpus()
    assert res is not None and res["lost"] and "exited 15" in res["error"]


def test_probe_gpus_timeout_never_raises(tmp_path, monkeypatch):
    _tool(tmp_path, "nvidia-smi", "exec /bin/sleep 20")
    monkeypatch.setenv("PATH", str(tmp_path))
    t0 = time.monotonic()
    res = probe_gpus(timedelta(seconds=0.3))
    assert time.monotonic() - t0 < 5
    assert res is not None and res["lost"] and "timed out" in res["error"]


def test_probe_kernel_xids(tmp_path, monkeypatch):
    (tmp_path / "dmesg.txt").write_text(DMESG)
    _tool(tmp_path, "dmesg", f"/bin/cat {tmp_path / 'dmesg.txt'}")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert probe_kernel_xids()["xid"] == (48, 13, 94, 14)
    assert probe_kernel_xids(since_uptime=2000.0)["xid"] == (94, 14)
    _tool(tmp_path, "dmesg", "echo 'dmesg: read kernel buffer failed: Operation not permitted' >&2;"
                             " exit 1")
    res = probe_kernel_xids()
    assert res["xid"] == () and "exited 1" in res["error"]


def test_probe_kernel_xids_from_the_journal_where_dmesg_is_restricted(tmp_path, monkeypatch):
    """kernel.dmesg_restrict (common on HPC nodes): the journal's kernel log (monotonic stamps) instead."""
    (tmp_path / "dmesg.txt").write_text(DMESG)
    _tool(tmp_path, "dmesg", "echo 'dmesg: read kernel buffer failed: Operation not permitted' >&2; exit 1")
    _tool(tmp_path, "journalctl", f"/bin/cat {tmp_path / 'dmesg.txt'}")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert probe_kernel_xids(since_uptime=2000.0)["xid"] == (94, 14)


def test_probe_is_bounded_when_the_tool_leaves_a_child_holding_its_output(tmp_path, monkeypatch):
    """GPU-REVIEW #16: a wedged tool whose child keeps the pipe open: killed with its process group, not waited
    for (subprocess.run waited for the pipe's end)."""
    import psutil

    _tool(tmp_path, "nvidia-smi", "/bin/sleep 31.25 & wait")
    monkeypatch.setenv("PATH", f"{tmp_path}:/bin:/usr/bin")
    t0 = time.monotonic()
    res = probe_gpus(timedelta(seconds=0.3))
    assert time.monotonic() - t0 < 5
    assert res is not None and "timed out" in res["error"]

    def left() -> list:
        return [p for p in psutil.process_iter(["cmdline", "status"])
                if p.info["cmdline"] == ["/bin/sleep", "31.25"] and p.info["status"] != psutil.STATUS_ZOMBIE]
    deadline = time.monotonic() + 5
    while left() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left(), "the tool's child outlived the probe"


def test_probe_slurm_node(tmp_path, monkeypatch):
    (tmp_path / "node.txt").write_text(SCONTROL_DOWN)
    _tool(tmp_path, "scontrol", f"/bin/cat {tmp_path / 'node.txt'}")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert probe_slurm_node("wn2") == "DOWN*"
    _tool(tmp_path, "scontrol", "echo 'slurm_load_node error: Unable to contact slurm controller' >&2;"
                                " exit 1")
    assert probe_slurm_node("wn2") is None
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert probe_slurm_node("wn2") is None


def test_probe_node_on_this_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi, no scontrol: only processes
    h = probe_node("here", [os.getpid()])
    assert h.passed and h.gpu is None and h.processes["alive"] == [os.getpid()]


def test_probe_evidence_reaches_the_classifier():
    """The agents' readings (Xid, ECC, a stopped rank) and the scheduler's node state become Signals evidence."""
    from phoenix_launch.detect.health import with_probe_evidence

    base = Signals(reports=(rep("n1", 0, exit_code=None, error=CLOSED, t=1.0), rep("n2", 2, exit_code=None, error=CLOSED, t=1.1)),
                   healthy_nodes=frozenset({"n1", "n2"}), world_ranks=4)
    assert classify(base).cls is TC
    v = classify(with_probe_evidence(base, {"n2": {"xid": [79], "problems": ["kernel logged Xid 79"]}}, {}))
    assert (v.cls, v.node) == (HO, "n2") and "Xid 79" in v.reason
    v = classify(with_probe_evidence(base, {"n1": {"ecc_uncorrected": 2, "problems": ["2 uncorrected ECC error(s)"]}}, {}))
    assert (v.cls, v.node) == (GM, "n1")
    v = classify(with_probe_evidence(base, {}, {"n2": "IDLE+DRAIN", "n1": "ALLOCATED"}))
    assert (v.cls, v.node) == (HO, "n2") and "IDLE+DRAIN" in v.reason
    v = classify(with_probe_evidence(base, {"n1": {"problems": ["rank process(es) in uninterruptible sleep (D): [7]"]}}, {}))
    assert (v.cls, v.node) == (NS, "n1")  # a comm error on a node that fails its probe: replaced


def test_one_table_of_communication_evidence_for_the_rank_and_the_classifier():
    """``COMM_EVIDENCE`` is read by both sides: its specific rows are the classifier's communication rows, and
    the rank also takes the broad ones (an exception caught in a step) but never a training bug's text."""
    from phoenix_launch.detect.failure_text import PATTERNS
    from phoenix_runtime.errors import COMM_EVIDENCE, comm_evidence

    comm_rows = [(p.name, p.regex.pattern) for p in PATTERNS if p.cls is FailureClass.TRANSIENT_COMM]
    assert comm_rows == [(e.name, e.regex) for e in COMM_EVIDENCE if e.classify]
    for text, row in [("[../gloo/transport/tcp/pair.cc:534] Read error [10.0.0.2]:41234: Connection reset by peer", "conn-reset"),
                      ("Timed out waiting 30000ms for recv operation to complete", "gloo-timeout"),
                      ("Gloo connectFullMesh failed with [..] no error", "backend"),
                      ("NCCL communicator was aborted on rank 3", "nccl-aborted")]:
        assert comm_evidence(text) == row, text
    assert comm_evidence("mat1 and mat2 shapes cannot be multiplied (4x8 and 7x8)") is None
