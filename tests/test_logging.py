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
