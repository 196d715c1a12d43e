"""A tiny GPT-2 (built from a config: no download) trained by Hugging Face's Trainer as ``PhoenixTrainer``
(tests/test_frameworks.py): 3 epochs of 12 update steps per rank, a loss logged every step, an evaluation every 4
steps, a checkpoint every 5 steps. Each rank writes ``<out>/digest-rank<r>.json`` (hashes of its final parameters,
optimizer state and scheduler state, and the loop's counters); rank 0 also ``<out>/log_history.json``, the Trainer's
log history without its timings."""

import argparse
import hashlib
import json
import os
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from phoenix_runtime.integrations.hf import PhoenixTrainer


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, 64, (n, 16), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def digest(trainer) -> dict:
    def h(tensors) -> str:
        m = hashlib.sha256()
        for name, t in tensors:
            m.update(name.encode())
            m.update(t.detach().cpu().contiguous().numpy().tobytes())
        return m.hexdigest()

    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    ostate = [(f"{i}.{k}", v) for i, st in sorted(opt.state_dict()["state"].items()) for k, v in sorted(st.items())
              if isinstance(v, torch.Tensor)]
    return {"params": h(sorted(trainer.model.state_dict().items())), "optim": h(ostate), "optim_tensors": len(ostate),
            "scheduler": repr(trainer.lr_scheduler.state_dict()), "global_step": trainer.state.global_step,
            "epoch": trainer.state.epoch}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = Path(a.out)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    args = TrainingArguments(output_dir=str(out / "hf"), per_device_train_batch_size=4, per_device_eval_batch_size=4,
                             num_train_epochs=3, learning_rate=3e-3, lr_scheduler_type="linear", logging_steps=1,
                             eval_strategy="steps", eval_steps=4, save_strategy="steps", save_steps=5,
                             report_to="none", use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0)
    trainer = PhoenixTrainer(model=model, args=args, train_dataset=Tokens(96, 1), eval_dataset=Tokens(16, 2))
    trainer.train()
    rank = int(os.environ.get("RANK", "0"))
    (out / f"digest-rank{rank}.json").write_text(json.dumps(digest(trainer)))
    if rank == 0:
        timings = ("runtime", "_time", "per_second", "total_flos")
        hist = [{k: v for k, v in e.items() if not any(t in k for t in timings)} for e in trainer.state.log_history]
        (out / "log_history.json").write_text(json.dumps(hist))


if __name__ == "__main__":
    main()
