"""PyTorch Lightning under PHOENIX: ``Trainer(strategy=PhoenixStrategy(), ...)``.

``PhoenixStrategy`` is Lightning's ``DDPStrategy`` (every keyword of it is accepted) that, under ``phoenix-run``:

- joins the job's process groups with ``phx.init()`` (Lightning's ``init_process_group`` then finds them made);
- hands the LightningModule, the optimizer and LR schedulers of ``configure_optimizers``, the precision plugin's
  GradScaler and the loop's own state (``_LoopState``: the fit loop's progress counters, its data position, the
  callbacks' state) to ``phx.protect``, which builds DDP itself (at the first step, and again
  on the new process groups after a recovery);
- runs each training batch of Lightning's loop (``_TrainingEpochLoop.advance`` and its ``on_advance_end``:
  validation, checkpoint callbacks; at an epoch's last batch the epoch's end too) inside the step guard, and the
  optimizer's step through ``optimizer_step()`` (the closure runs first: forward and backward; then the step waits
  for the replica commit);
- after a recovery, the loop continues at the resume step: its counters are S_R's, and the training batches of
  the replayed steps are given again (``_Fetcher``: kept from the iterator; a replacement rank positions its
  iterator anew: the sampler's epoch, then the batches before R read and dropped, the RNG untouched).

A replacement rank runs ``trainer.fit`` from its start: until its first step (where it recovers with the
survivors) its collectives are its own (barriers pass, broadcasts and reductions return its values) and Lightning's
sanity check is skipped, since the survivors are in their training loop. Outside phoenix-run it is ``DDPStrategy``.

Not protected (refused with one line): more than one optimizer, ``accumulate_grad_batches`` > 1, a
``training_step`` that takes the ``dataloader_iter``. A replayed step runs its hooks again (a logger gets its
metrics twice, the last wins; a checkpoint callback saves again). A replacement of rank 0 logs into its logger's next
version (``version_1``): Lightning's CSVLogger empties a version it opens again.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loops import _Loop
from lightning.pytorch.loops.fetchers import _DataLoaderIterDataFetcher
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

import phoenix_runtime as phx
from phoenix_runtime.errors import UsageError
from phoenix_runtime.integrations.replay import Replay, fork_rng, guard_step, guarded, managed

if TYPE_CHECKING:
    from phoenix_runtime.training import ProtectedTraining

log = logging.getLogger(__name__)

# ModelCheckpoint's decisions that its state_dict leaves out: every rank must take the same (they broadcast)
_CKPT_PRIVATE = ("_last_global_step_saved", "_last_checkpoint_saved")


class PhoenixStrategy(DDPStrategy):
    strategy_name = "phoenix"

    def __init__(self, *, replicas: int | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self._managed = managed()
        self._replicas = replicas
        self.training: ProtectedTraining | None = None  # phx.protect's ProtectedTraining, under phoenix-run once fitting
        self._local = False  # a replacement rank before its first step: its collectives are its own
        self._epoch_end_ran = False

    # --- the process groups --------------------------------------------------------------------------------------
    def setup_distributed(self) -> None:
        if not self._managed:
            return super().setup_distributed()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        ctx = phx.init(backend=self._process_group_backend)
        self._local = ctx.formed_after_a_failure

    def configure_ddp(self) -> None:
        if not self._managed:
            return super().configure_ddp()
        # PHOENIX builds DDP at the first step and again on each generation's group (phx.protect)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not self._local:
            super().barrier(*args, **kwargs)

    def broadcast(self, obj, src: int = 0):
        return obj if self._local else super().broadcast(obj, src)

    def reduce(self, tensor, group=None, reduce_op="mean"):
        return tensor if self._local else super().reduce(tensor, group, reduce_op)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 (Lightning's name)
        return decision if self._local else super().reduce_boolean_decision(decision, all)

    # --- protection ----------------------------------------------------------------------------------------------
    def setup(self, trainer) -> None:
        super().setup(trainer)
        if self._managed and trainer.state.fn == TrainerFn.FITTING:
            self._protect(trainer)

    def _protect(self, trainer) -> None:
        if len(self.optimizers) != 1:
            raise UsageError(f"PhoenixStrategy: configure_optimizers returned {len(self.optimizers)} optimizers; "
                             "PHOENIX protects one")
        if trainer.accumulate_grad_batches != 1:
            raise UsageError("PhoenixStrategy: accumulate_grad_batches > 1 is not supported yet (a PHOENIX step is "
                             "one training batch)")
        opt = self.optimizers[0]
        self.training = phx.protect(
            self.lightning_module, opt, ddp=dict(self._ddp_kwargs), replicas=self._replicas,
            schedulers=[c.scheduler for c in self.lr_scheduler_configs],
            scaler=getattr(self.precision_plugin, "scaler", None),
            stateful={"lightning": _LoopState(trainer)})
        guard_step(opt, self.training)
        self._hook_loops(trainer)
        if self._local:  # the survivors are in their training loop: no sanity check with them
            trainer.num_sanity_val_steps = 0

    def _hook_loops(self, trainer) -> None:
        """Each training batch of the epoch loop, with its follow-up (validation, checkpoints) and, at an epoch's last
        batch, the epoch's end, is one PHOENIX step."""
        fit, epoch = trainer.fit_loop, trainer.fit_loop.epoch_loop
        advance, advance_end, epoch_end, setup_data = epoch.advance, epoch.on_advance_end, fit.on_advance_end, fit.setup_data

        def one_step(data_fetcher) -> None:
            self._epoch_end_ran = False

            def body():
                self._follow()
                self._local = False  # recovered with the survivors (a replacement), or never local
                advance(data_fetcher)
                advance_end(data_fetcher)
                if epoch.done:  # the epoch's end belongs to its last step (its hooks communicate)
                    epoch_end()
                    self._epoch_end_ran = True

            training = self.training
            assert training is not None  # protected (_protect) before the loops are hooked
            if training.rs.total is None:
                total = trainer.estimated_stepping_batches
                training.rs.total = int(total) if math.isfinite(total) else None
            if not guarded(training, body):
                self._epoch_end_ran = False
            self._follow()

        def fit_advance_end() -> None:
            if self._epoch_end_ran:
                self._epoch_end_ran = False
                return
            epoch_end()

        def setup_data_() -> None:
            setup_data()
            f = fit._data_fetcher
            if f is not None and not isinstance(f, _Fetcher):
                if isinstance(f, _DataLoaderIterDataFetcher):
                    raise UsageError("PhoenixStrategy: a training_step that takes the dataloader_iter is not supported")
                fit._data_fetcher = _Fetcher(f, trainer)

        epoch.advance = one_step
        epoch.on_advance_end = lambda data_fetcher: None
        fit.on_advance_end = fit_advance_end
        fit.setup_data = setup_data_

    def _follow(self) -> None:
        """Lightning's references on the live DDP (a new one after a recovery); a forward redirection cut short by
        the failure leaves its patched ``forward`` on the module: dropped."""
        assert self.training is not None  # protected (_protect) before the loops are hooked
        self.model = self.training.model
        lm = self.lightning_module
        f = lm.__dict__.get("forward")
        if f is not None and getattr(f, "__name__", "") == "wrapped_forward":
            del lm.__dict__["forward"]

    def teardown(self) -> None:
        if self.training is not None:
            self.training.close()
            self.training = None
        super().teardown()


def _position(trainer) -> tuple[int, int]:
    """The loop's data position: (epoch, batch within it) of the next training batch."""
    fit = trainer.fit_loop
    return fit.epoch_progress.current.processed, fit.epoch_loop.batch_progress.current.ready


def _load_progress(loop: _Loop, sd: dict, prefix: str = "") -> None:
    """A loop's progress counters from its ``state_dict`` (Lightning's own ``load_state_dict`` also marks the loops
    as restarting from a checkpoint, which a rollback inside a live loop is not)."""
    loop._load_from_state_dict(dict(sd), prefix)
    for k, v in vars(loop).items():
        if isinstance(v, _Loop):
            _load_progress(v, sd, prefix + k + ".")


class _LoopState:
    """The loop's own state, in each step's envelope: the fit loop's progress (epochs, batches, optimizer and
    scheduler steps, validation), the data position, the callbacks' state (a replacement rank 0's checkpoint
    callbacks save where the lost one's did). Loggers are not moved: a replacement of rank 0 logs into its logger's
    next version (a CSVLogger opened on an existing version would empty it)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def state_dict(self) -> dict:
        t = self.trainer
        callbacks = {cb.state_key: cb.state_dict() for cb in t.callbacks}
        private = {cb.state_key: {k: getattr(cb, k) for k in _CKPT_PRIVATE if hasattr(cb, k)}
                   for cb in t.callbacks if isinstance(cb, ModelCheckpoint)}
        return {"loops": t.fit_loop.state_dict(), "pos": _position(t), "callbacks": callbacks, "private": private}

    def load_state_dict(self, sd: dict) -> None:
        t = self.trainer
        _load_progress(t.fit_loop, sd["loops"])
        for cb in t.callbacks:
            state = sd["callbacks"].get(cb.state_key)
            if isinstance(cb, ModelCheckpoint) and state is not None:
                cb.dirpath = state.get("dirpath", cb.dirpath)
                for k, v in sd["private"].get(cb.state_key, {}).items():
                    setattr(cb, k, v)
            if state:
                cb.load_state_dict(state)
        f = t.fit_loop._data_fetcher
        if isinstance(f, _Fetcher):
            f.rewind(tuple(sd["pos"]))


class _Fetcher:
    """Lightning's training data fetcher as the epoch loop sees it, keeping the last batches by position
    (``_position``) so that a rolled-back loop is given them again; everything else is the fetcher's."""

    _OWN = ("_inner", "_trainer", "_replay", "_live", "_done")

    def __init__(self, inner, trainer):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_trainer", trainer)
        object.__setattr__(self, "_replay", Replay())
        object.__setattr__(self, "_live", (trainer.fit_loop.epoch_progress.current.processed, 0))
        object.__setattr__(self, "_done", None)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self._inner, name, value)

    @property
    def done(self) -> bool:
        return self._inner.done if self._done is None else self._done

    def __iter__(self):
        iter(self._inner)
        self._replay.drop_queue()
        self._live = (self._trainer.fit_loop.epoch_progress.current.processed, 0)
        self._done = None
        return self

    def __next__(self):
        if self._replay.replaying:
            _, (item, done) = self._replay.next_queued()
            self._done = done
            return item
        self._done = None
        pos = self._live
        item = next(self._inner)
        self._live = (pos[0], pos[1] + 1)
        self._replay.kept(pos, (item, self._inner.done))
        return item

    def rewind(self, to: tuple[int, int]) -> None:
        """The loop goes back to position ``to``: the kept batches from it up to the iterator's next are queued (within
        ``to``'s epoch: the next epoch's iterator is made anew at its start); not kept (a replacement rank): the
        iterator is positioned anew."""
        self._done = None
        self._replay.drop_queue()
        live = self._live
        if to == live or self._replay.rewind(to, lambda p: p < live and p[0] == to[0]):
            return
        epoch, index = to
        with fork_rng():  # making an iterator draws a seed: the run's RNG is S_R's, restored already
            for dl in self._trainer.fit_loop._combined_loader.flattened:
                _set_sampler_epoch(dl, epoch)
            iter(self._inner)
            for _ in range(index):
                next(self._inner)
        self._live = to
        log.info(f"training data positioned at epoch {epoch}, batch {index} ({index} batches read and dropped)")
