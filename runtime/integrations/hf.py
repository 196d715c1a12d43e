"""Hugging Face ``transformers.Trainer`` under PHOENIX: ``PhoenixTrainer`` in place of ``Trainer`` (same arguments).

Importing this module under ``phoenix-run`` joins the job's process groups (``phx.init()``), before accelerate's
``PartialState`` would make its own (it then finds them made). ``PhoenixTrainer`` is ``Trainer`` that, under
phoenix-run:

- keeps the model bare (accelerate prepares the optimizer only) and hands the model, the optimizer, the LR scheduler,
  accelerate's GradScaler and the loop's own state (``_LoopState``: the position (epoch, update step), the
  ``TrainerState`` with its log history, the ``TrainerControl``, the running loss) to ``phx.protect``, which builds
  DDP itself (at the first step, and again on the new process groups after a recovery);
- runs each update step of the epoch (its micro-batches, the optimizer step through ``optimizer_step()``, the
  callbacks, ``_maybe_log_save_evaluate``: logging, evaluation, checkpoints; at an epoch's last step the epoch's
  end too) inside the step guard: ``_run_epoch`` is the same sequence of Trainer calls as transformers' own, on
  PHOENIX's loop, which continues at the resume step after a recovery;
- reads the training data itself, each epoch's iterator made without moving the run's RNG and without accelerate's
  synchronisation of the sampler's generator (the seedable sampler is seeded per epoch on every rank alike); the
  batches of the last steps are kept, so that a survivor rolled back is given them again; a replacement rank
  positions a new iterator (the batches before R read and dropped).

Outside phoenix-run it is ``Trainer``. Not protected yet: DeepSpeed, FSDP, XLA, SageMaker (refused, one line); a
replayed step runs its callbacks and logging again (the log history is rolled back with the state, so it holds each
step once). A replacement of rank 0 writes the checkpoints from there on as the lost one would have.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch
from transformers import Trainer, TrainerControl, TrainerState

import phoenix_runtime as phx
from phoenix_runtime.errors import UsageError
from phoenix_runtime.integrations.replay import Replay, fork_rng, guard_step, guarded, managed

log = logging.getLogger(__name__)

if managed():
    phx.init()


class _Bare(torch.nn.Module):
    """What the Trainer's ``_wrap_model`` returns under PHOENIX: the model, held (not DDP: PHOENIX builds that), so
    that accelerate prepares the optimizer only."""

    def __init__(self, model):
        super().__init__()
        self.module = model

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class PhoenixTrainer(Trainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._phx = None  # phx.protect's ProtectedTraining, under phoenix-run once training
        self._phx_pos = (0, 0)  # (epoch, update step) of the next step
        self._phx_replay = Replay()
        self._phx_it = None
        self._phx_live = None  # (epoch, update step) the iterator gives next
        self._phx_norm = self._phx_lr = None

    # --- protection ----------------------------------------------------------------------------------------------
    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if training and managed():
            if self.is_deepspeed_enabled or self.is_fsdp_enabled or self.is_fsdp_xla_enabled:
                raise UsageError("PhoenixTrainer: DeepSpeed, FSDP and XLA are not supported yet; DDP is")
            return _Bare(self.model)
        return super()._wrap_model(model, training, dataloader)

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        if isinstance(model, _Bare) and self._phx is None:
            opt = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's AcceleratedOptimizer holds it
            self._phx = phx.protect(self.model, opt, schedulers=[self.lr_scheduler],
                                    scaler=getattr(self.accelerator, "scaler", None), stateful={"hf": _LoopState(self)})
            self._phx.rs.total = max_steps
            guard_step(opt, self._phx)
        return model, train_dataloader

    # --- the loop ------------------------------------------------------------------------------------------------
    def _run_epoch(self, model, epoch, train_dataloader, steps_in_epoch, num_update_steps_per_epoch, trial,
                   ignore_keys_for_eval, start_time, **kwargs):
        if self._phx is None:
            return super()._run_epoch(model=model, epoch=epoch, train_dataloader=train_dataloader, steps_in_epoch=steps_in_epoch,
                                      num_update_steps_per_epoch=num_update_steps_per_epoch, trial=trial,
                                      ignore_keys_for_eval=ignore_keys_for_eval, start_time=start_time, **kwargs)
        self._phx_dl = train_dataloader
        if self._phx_pos[0] < epoch:
            self._phx_pos = (epoch, 0)
        shape = (steps_in_epoch, num_update_steps_per_epoch)
        # a replacement rank may resume in a later epoch than the Trainer's: the calls for the epochs before it return
        while self._phx_pos[0] <= epoch and not self.control.should_training_stop:
            guarded(self._phx, lambda: self._update_step(shape, trial, ignore_keys_for_eval, start_time))

    def _update_step(self, shape, trial, ignore_keys_for_eval, start_time) -> None:
        """One update step at ``_phx_pos`` (transformers' ``_run_epoch`` body), and the epoch's end after its last."""
        steps_in_epoch, n_updates = shape
        epoch, u = self._phx_pos
        acc, live = self.args.gradient_accumulation_steps, self._phx.model
        remainder = steps_in_epoch % acc or acc
        samples = self._batches(epoch, u, acc if u != n_updates - 1 else remainder)
        num_items_in_batch = self._get_num_items_in_batch(samples, self.args.device)
        self.current_gradient_accumulation_steps = len(samples)
        for i, inputs in enumerate(samples):
            step = u * acc + i
            do_sync_step = (step + 1) % acc == 0 or (step + 1) == steps_in_epoch
            self.accelerator.gradient_state._set_sync_gradients(do_sync_step)
            if step % acc == 0:
                self.control = self.callback_handler.on_step_begin(self.args, self.state, self.control)
            no_sync = getattr(live, "no_sync", None)
            with no_sync() if no_sync is not None and i != len(samples) - 1 else contextlib.nullcontext():
                tr_loss_step = self.training_step(live, inputs, num_items_in_batch)
            if self.args.logging_nan_inf_filter and (torch.isnan(tr_loss_step) or torch.isinf(tr_loss_step)):
                self._tr_loss += self._tr_loss / (1 + self.state.global_step - self._globalstep_last_logged)
            else:
                self._tr_loss += tr_loss_step
            # transformers starts current_flos as the int 0 and adds floats to it (its own loop does the same)
            self.current_flos += float(self.floating_point_ops(inputs))  # type: ignore[assignment]
            self._track_num_input_tokens(inputs)
            if do_sync_step:
                norm = self._clip_grad_norm(live) if self.args.max_grad_norm > 0 else None
                self._phx_norm = self._get_grad_norm(live, grad_norm=norm)
                self.control = self.callback_handler.on_pre_optimizer_step(self.args, self.state, self.control)
                assert self.optimizer is not None  # the training loop made it (and the scheduler)
                self.optimizer.step()  # PHOENIX's optimizer_step() (guard_step): the replica commit, then the step
                self.control = self.callback_handler.on_optimizer_step(self.args, self.state, self.control)
                self._phx_lr = self._get_learning_rate()
                if not self.accelerator.optimizer_step_was_skipped and not isinstance(
                        self.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                    assert self.lr_scheduler is not None
                    self.lr_scheduler.step()
                live.zero_grad()
                self.state.global_step += 1
                self.state.epoch = epoch + (step + 1) / steps_in_epoch
                self.control = self.callback_handler.on_step_end(self.args, self.state, self.control)
                self._maybe_log_save_evaluate(self._tr_loss, self._phx_norm, live, trial, epoch, ignore_keys_for_eval,
                                              start_time, learning_rate=self._phx_lr)
            else:
                self.control = self.callback_handler.on_substep_end(self.args, self.state, self.control)
            if self.control.should_epoch_stop or self.control.should_training_stop:
                break
        if u == n_updates - 1 or self.control.should_epoch_stop or self.control.should_training_stop:
            # the epoch's end belongs to its last step (evaluation and checkpoints communicate)
            self.control = self.callback_handler.on_epoch_end(self.args, self.state, self.control)
            self._maybe_log_save_evaluate(self._tr_loss, self._phx_norm, live, trial, epoch, ignore_keys_for_eval,
                                          start_time, learning_rate=self._phx_lr)
            self._phx_pos = (epoch + 1, 0)
        else:
            self._phx_pos = (epoch, u + 1)

    def _batches(self, epoch: int, u: int, n: int) -> list:
        """The micro-batches of update step ``u`` of ``epoch``: kept (a replayed step), or read from the iterator,
        made anew where it does not stand there."""
        kept = self._phx_replay.get((epoch, u))
        if kept is not None:
            return kept
        if self._phx_live != (epoch, u):
            self._open(epoch, u)
        samples = []
        for _ in range(n):
            try:
                samples.append(next(self._phx_it))
            except StopIteration:
                break
        self._phx_live = (epoch, u + 1)
        self._phx_replay.kept((epoch, u), samples)
        return samples

    def _open(self, epoch: int, u: int) -> None:
        """The epoch's iterator, at update step ``u`` (its micro-batches before it read and dropped), made without
        moving the run's RNG; its sampler is seeded by the epoch on every rank (no synchronisation: a collective the
        other ranks would not join when one rank alone makes an iterator)."""
        dl, skip = self._phx_dl, u * self.args.gradient_accumulation_steps
        with fork_rng():
            if hasattr(dl, "rng_types"):
                dl.rng_types = None
            if hasattr(dl, "set_epoch"):
                dl.set_epoch(epoch)
            inner = getattr(getattr(dl, "batch_sampler", None), "batch_sampler", None)
            if inner is not None and hasattr(inner, "set_epoch"):
                inner.set_epoch(epoch)
            self._phx_it = iter(dl)
            for _ in range(skip):
                next(self._phx_it)
        if skip:
            log.info(f"training data positioned at epoch {epoch}, batch {skip} ({skip} batches read and dropped)")

    def _finalize_training(self, *args, **kwargs):
        out = super()._finalize_training(*args, **kwargs)
        if self._phx is not None:
            self._phx.close()
            self._phx = None
        return out


class _LoopState:
    """The Trainer's loop state, in each step's envelope."""

    def __init__(self, trainer: PhoenixTrainer):
        self.t = trainer

    def state_dict(self) -> dict:
        t = self.t
        return {"pos": t._phx_pos, "state": dataclasses.asdict(t.state), "control": dataclasses.asdict(t.control),
                "tr_loss": t._tr_loss.detach().cpu().clone(), "total_loss_scalar": t._total_loss_scalar,
                "last_logged": t._globalstep_last_logged, "flos": t.current_flos, "norm": t._phx_norm, "lr": t._phx_lr}

    def load_state_dict(self, sd: dict) -> None:
        t = self.t
        t._phx_pos = tuple(sd["pos"])
        t.state = TrainerState(**sd["state"])
        t.control = TrainerControl(**sd["control"])
        t._tr_loss = sd["tr_loss"].to(t.args.device)
        t._total_loss_scalar, t._globalstep_last_logged = sd["total_loss_scalar"], sd["last_logged"]
        t.current_flos, t._phx_norm, t._phx_lr = sd["flos"], sd["norm"], sd["lr"]
