"""PHOENIX runtime, injected into every rank by ``phoenix-run``.

    import phoenix_runtime as phx
    phx.init(); training = phx.protect(model, optimizer)

The package stays importable without torch (``phoenix_runtime.protocol`` and ``settings`` are shared with
the launcher): the API is loaded on first use.
"""

__all__ = ["init", "protect", "ProtectedTraining", "Trainer"]


def __getattr__(name):
    if name in __all__:
        from phoenix_runtime import api

        return getattr(api, name)
    raise AttributeError(f"module 'phoenix_runtime' has no attribute {name!r}")
