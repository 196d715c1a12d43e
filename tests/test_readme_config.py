"""README's configuration list is the configuration: every key of every section of ``config.py``, no other, each with
the default ``config.py`` gives it (a key added to the code and not to the README fails here)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from phoenix_launch.config import SECTIONS

README = Path(__file__).resolve().parent.parent / "README.md"


def _readme_config() -> dict:
    section = README.read_text().split("## Configuration file", 1)[1]
    return yaml.safe_load(section.split("```yaml", 1)[1].split("```", 1)[0])


def _plain(value):
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


@pytest.mark.timeout(30)
def test_the_readme_lists_every_key_with_its_default():
    listed = _readme_config()
    assert sorted(listed) == sorted(SECTIONS)
    for name, f in SECTIONS.items():
        defaults = dataclasses.asdict(f.default_factory())
        assert sorted(listed[name]) == sorted(defaults), f"{name}: the README and config.py list other keys"
        for key, value in defaults.items():
            assert _plain(listed[name][key]) == _plain(value), (
                f"{name}.{key}: README says {listed[name][key]!r}, config.py {value!r}"
            )
