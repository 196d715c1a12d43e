"""PHOENIX under the training frameworks that own the loop: ``lightning`` (PyTorch Lightning's ``PhoenixStrategy``)
and ``hf`` (Hugging Face ``transformers.Trainer``: ``PhoenixTrainer``). Each is imported on its own: neither
framework is a dependency of the runtime (the ``frameworks`` extra installs both)."""
