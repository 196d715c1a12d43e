"""Every config of ``torchtitan.models.llama3.config_registry`` (``llama3_debugmodel``, ``llama3_8b``...), the same
but trained by ``PhoenixTrainer``."""

from __future__ import annotations

from torchtitan.models.llama3 import config_registry as _titan

from phoenix_titan.trainer import phoenix_config


def _wrap(name: str, fn):
    def config() -> "PhoenixTrainer.Config":  # noqa: F821
        return phoenix_config(fn())

    config.__name__ = config.__qualname__ = name
    config.__doc__ = f"torchtitan's {name}, trained by PhoenixTrainer."
    return config


for _name, _fn in list(vars(_titan).items()):
    if _name.startswith("llama3_") and callable(_fn):
        globals()[_name] = _wrap(_name, _fn)
