"""PHOENIX runtime, injected into every rank by ``phoenix-run``.

    import phoenix_runtime as phx
    phx.init(); training = phx.protect(model, optimizer)

The package stays importable without torch (``phoenix_runtime.plane.protocol`` and ``settings`` are shared with
the launcher): the API is loaded on first use. Every exception PHOENIX raises derives from ``PhoenixError``.
"""

from phoenix_runtime.errors import PhoenixError

__all__ = ["init", "protect", "ProtectedTraining", "PhoenixError"]


def __getattr__(name):
    if name in ("init", "protect", "ProtectedTraining"):
        from phoenix_runtime import api

        return getattr(api, name)
    raise AttributeError(f"module 'phoenix_runtime' has no attribute {name!r}")
