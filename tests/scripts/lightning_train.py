"""A LightningModule trained by Lightning's Trainer with ``PhoenixStrategy`` (tests/test_frameworks.py).

A small MLP with dropout (the RNG is state) on a random regression set built here, AdamW and a StepLR schedule from
``configure_optimizers``, validation every 4 batches, a ModelCheckpoint every 5 steps (every checkpoint kept) and
a CSVLogger. Each rank writes ``<out>/digest-rank<r>.json``: hashes of its final parameters, optimizer state and
scheduler state, and the loop's final counters."""

import argparse
import hashlib
import json
import os
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from phoenix_runtime.integrations.lightning import PhoenixStrategy


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 7, 0.5), "interval": "step"}}


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True).sin() + 0.1 * torch.randn(n, 1, generator=g))


def digest(trainer, module) -> dict:
    def h(tensors) -> str:
        m = hashlib.sha256()
        for name, t in tensors:
            m.update(name.encode())
            m.update(t.detach().cpu().contiguous().numpy().tobytes())
        return m.hexdigest()

    opt = trainer.optimizers[0]
    ostate = [(f"{i}.{k}", v) for i, st in sorted(opt.state_dict()["state"].items()) for k, v in sorted(st.items())
              if isinstance(v, torch.Tensor)]
    return {"params": h(sorted(module.state_dict().items())), "optim": h(ostate), "optim_steps": len(ostate),
            "scheduler": repr(trainer.lr_scheduler_configs[0].scheduler.state_dict()),
            "global_step": trainer.global_step, "epoch": trainer.current_epoch}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--nodes", type=int, default=2)
    a = ap.parse_args()
    out = Path(a.out)
    L.seed_everything(0, workers=True)
    module = Regressor()
    ckpt = ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=5, save_top_k=-1, filename="{step}")
    trainer = L.Trainer(accelerator="cpu", devices=1, num_nodes=a.nodes, strategy=PhoenixStrategy(), max_epochs=a.epochs,
                        logger=CSVLogger(out, name="logs"), callbacks=[ckpt], val_check_interval=4, log_every_n_steps=1,
                        enable_progress_bar=False, enable_model_summary=False, deterministic=True)
    trainer.fit(module, DataLoader(data(96, 1), batch_size=4, shuffle=True), DataLoader(data(16, 2), batch_size=4))
    rank = int(os.environ.get("RANK", "0"))
    (out / f"digest-rank{rank}.json").write_text(json.dumps(digest(trainer, module)))


if __name__ == "__main__":
    main()
