"""Log lines through ``logging``: a rank's keep the ``[phoenix HH:MM:SS.mmm rank R]`` prefix, a launcher's are
the message alone; one handler per process however often it is configured."""
import logging
import re

import pytest

from phoenix_runtime import logs

pytestmark = pytest.mark.timeout(30)


def test_a_rank_line_keeps_its_format(monkeypatch, capsys):
    logs.configure_rank()
    logs.configure_rank()
    monkeypatch.setattr(logs, "rank_source", lambda: 3)
    logging.getLogger("phoenix_runtime.somewhere").info("generation 1: resumed at step 4 (100%)")
    monkeypatch.setattr(logs, "rank_source", lambda: None)  # a spare not assigned yet
    logging.getLogger("phoenix_runtime.plane.bootstrap").info("spare warm: waiting for an assignment")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2, err
    assert re.fullmatch(r"\[phoenix \d\d:\d\d:\d\d\.\d{3} rank 3\] generation 1: resumed at step 4 \(100%\)", err[0]), err
    assert re.fullmatch(r"\[phoenix \d\d:\d\d:\d\d\.\d{3}\] spare warm: waiting for an assignment", err[1]), err


def test_a_launcher_line_is_the_message(capsys):
    logs.configure_launcher()
    logs.configure_launcher()
    logging.getLogger("phoenix_launch.detect.agent").error("phoenix agent node1: control plane lost (x); stopping ranks")
    assert capsys.readouterr().err == "phoenix agent node1: control plane lost (x); stopping ranks\n"
    assert not logging.getLogger("phoenix_launch").propagate


def test_a_ranks_lines_go_to_its_log_file_only(tmp_path, monkeypatch, capsys):
    """Under phoenix-run (the agent names the rank's log file) PHOENIX's own lines of a rank are appended to that
    file, beside what is already there, and none reaches stderr, which the console shows as the user's output."""
    from phoenix_runtime.plane import rank_env

    log_file = tmp_path / "0.0.log"
    log_file.write_text("hello from the script\n")
    monkeypatch.setattr(rank_env, "_ENV", rank_env.RankEnv.from_environ({"PHOENIX_LOG_FILE": str(log_file)}))
    monkeypatch.setattr(logs, "rank_source", lambda: 0)
    logger = logging.getLogger("phoenix_runtime")
    monkeypatch.setattr(logger, "handlers", [])  # this process's own handler (another test's) set aside
    logs.configure_rank()
    logs.configure_rank()
    logging.getLogger("phoenix_runtime.plane.context").info("generation 0: arrived")
    for h in logger.handlers:
        h.close()
    assert capsys.readouterr().err == ""
    lines = log_file.read_text().splitlines()
    assert lines[0] == "hello from the script" and len(lines) == 2, lines
    assert re.fullmatch(r"\[phoenix \d\d:\d\d:\d\d\.\d{3} rank 0\] generation 0: arrived", lines[1]), lines
