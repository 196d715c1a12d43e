"""Test data for the torchtitan runs, made locally (nothing is downloaded): a byte-level BPE tokenizer trained
on a small generated corpus (``tokenizer/``: tokenizer.json + tokenizer_config.json, the HuggingFace layout
torchtitan's ``HuggingFaceTokenizer`` loads) and the corpus itself as ``corpus/train.json`` (JSON lines with a
``text`` field, the c4_test layout ``load_dataset(path, split="train")`` reads)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

VOCAB = 512  # below the debug model's 2048 embeddings
WORDS = ("phoenix spare node rank step loss shard replica gradient optimizer tensor mesh pipeline stage "
         "recovery commit snapshot checkpoint failure swap warm cold network memory device process group "
         "the a of to in and is on for with by from at as it this that an be are was").split()


def corpus(n_docs: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        sentences = []
        for _ in range(rng.randint(3, 12)):
            words = [rng.choice(WORDS) for _ in range(rng.randint(4, 16))]
            sentences.append(" ".join(words).capitalize() + ".")
        docs.append(" ".join(sentences))
    return docs


def make(root: Path) -> tuple[Path, Path]:
    """(tokenizer dir, corpus dir) under ``root``; made once (idempotent)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok_dir, data_dir = root / "tokenizer", root / "corpus"
    if (tok_dir / "tokenizer.json").exists() and (data_dir / "train.json").exists():
        return tok_dir, data_dir
    docs = corpus()
    tok_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True}))
    with open(data_dir / "train.json", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    return tok_dir, data_dir


if __name__ == "__main__":
    print(*make(Path(sys.argv[1])))
