"""One exception root: every exception class of the runtime and the launcher derives from PhoenixError,
and the launcher's CLI shows one as one line with a non-zero exit."""
import importlib
import inspect
import pkgutil

import pytest

import phoenix_launch
import phoenix_runtime
from phoenix_runtime.errors import PhoenixError

pytestmark = pytest.mark.timeout(120)


def _exception_classes():
    found = {}
    for pkg in (phoenix_runtime, phoenix_launch):
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if info.name.endswith(".__main__"):  # runs the CLI when imported
                continue
            mod = importlib.import_module(info.name)
            for name, obj in vars(mod).items():
                if (inspect.isclass(obj) and issubclass(obj, BaseException) and not issubclass(obj, Warning)
                        and obj.__module__ == mod.__name__):
                    found[f"{mod.__name__}.{name}"] = obj
    return found


def test_every_exception_class_derives_from_phoenix_error():
    classes = _exception_classes()
    assert len(classes) > 20, sorted(classes)  # the walk did reach the modules
    assert [n for n, c in classes.items() if not issubclass(c, PhoenixError)] == []


def test_the_root_is_exported_and_names_do_not_clash():
    assert phoenix_runtime.PhoenixError is PhoenixError
    names = [n.rsplit(".", 1)[1] for n in _exception_classes()]
    from phoenix_runtime.plane import protocol

    messages = {c.__name__ for c in vars(protocol).values() if inspect.isclass(c) and issubclass(c, protocol.Message)}
    assert not messages & set(names), messages & set(names)  # a message and an exception never share a name
    assert len(names) == len(set(names))


def test_a_phoenix_error_reaching_the_cli_is_one_line(monkeypatch, capsys):
    from phoenix_launch import cli
    from phoenix_runtime.errors import UsageError

    def refuse(*a, **k):
        raise UsageError("no such thing")

    monkeypatch.setattr(cli, "app", refuse)
    with pytest.raises(SystemExit) as e:
        cli.main(["status"])
    assert e.value.code == 1
    assert capsys.readouterr().err == "phoenix-run: error: no such thing\n"
