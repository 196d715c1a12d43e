"""torchtitan's Trainer under PHOENIX (``phoenix-run -m torchtitan.train --module phoenix_titan.llama3 ...``).

``PhoenixTrainer`` (``trainer.py``) is torchtitan's ``Trainer`` with its model parts, optimizers, LR schedulers, data
loader and own state (``step``, ``ntokens_seen``) under ``phx.protect`` and ``train_step`` under the step guard;
``llama3`` is torchtitan's llama3 config registry with that trainer. ``compat`` holds the shims for the
torch / torchtitan version mismatch (torchtitan 0.3.0 is written against a newer torch than 2.13).
"""

from phoenix_titan import compat

compat.apply()
