"""A ``Context`` for tests that drive its formation or abort directly, on a real store, without a job around it.

It is built by ``Context.__init__`` itself (an unmanaged ``RankEnv``), so every attribute a later change adds to
the constructor exists here too; then it is made managed, on ``store``, with a control thread's one field that
formation reads (``latest_gen``) in a plain namespace the test can move.
"""

from types import SimpleNamespace

from phoenix_runtime.plane.context import Context
from phoenix_runtime.plane.rank_env import RankEnv
from phoenix_runtime.plane.settings import RuntimeSettings


def bare_context(rank: int, world: int, store, latest_gen: int = 1, gen: int = 1, **settings) -> Context:
    """Rank ``rank`` of ``world`` on ``store`` (anything with the store calls the test reaches), generation ``gen``,
    the control thread's newest generation ``latest_gen``; ``settings``: RuntimeSettings fields."""
    env = RankEnv(managed=False, rank=rank, world_size=world, gen=gen, settings=RuntimeSettings(**settings))
    ctx = Context(env, "gloo", 1, 1)
    ctx.managed, ctx.store = True, store
    ctx.ctl = SimpleNamespace(latest_gen=latest_gen, watching=True)  # ``latest_gen()`` reads it
    return ctx


def store_barrier(store, world: int, name: str, timeout: float = 60.0) -> None:
    """Every one of ``world`` ranks reached ``name``, counted on ``store`` (the groups under test carry nothing)."""
    import time

    store.add(name, 1)
    deadline = time.monotonic() + timeout
    while int(store.add(name, 0)) < world:
        if time.monotonic() > deadline:
            raise TimeoutError(name)
        time.sleep(0.01)
