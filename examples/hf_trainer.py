"""A Hugging Face transformers model, built from a config, trained by the Trainer with numwatch.

    python examples/hf_trainer.py --steps 40                 # CPU, tiny Llama, under a minute
    python examples/hf_trainer.py --preset small --steps 2000 # on a GPU

The model uses ``attn_implementation="numwatch"`` (transformers' SDPA path, registered with its
mask function) so the attention probe sees it and kernel hot-swap can route it. Data is a
synthetic bigram language generated here; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import math
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from numwatch.integrations.hf_trainer import NumwatchTrainerCallback
from numwatch.integrations.transformers import register_attention

PRESETS = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=64, max_position_embeddings=64),
    "small": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, vocab_size=512,
                  max_position_embeddings=256),
}  # fmt: skip


class Bigram(torch.utils.data.Dataset):
    """Sequences of a random sparse bigram language (token 0 = BOS), fixed by the seed."""

    def __init__(self, vocab: int, seq_len: int, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(vocab, vocab, generator=g) * 3.0
        logits[:, 0] = -math.inf
        probs = logits.softmax(-1)
        seq = torch.zeros(n, seq_len, dtype=torch.long)
        for t in range(1, seq_len):
            seq[:, t] = torch.multinomial(probs[seq[:, t - 1]], 1, generator=g).squeeze(1)
        self.seq = seq

    def __len__(self) -> int:
        return len(self.seq)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.seq[i], "labels": self.seq[i]}


def main(argv: list[str] | None = None) -> float:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--jsonl", default=None)
    p.add_argument("--output-dir", default=None)
    args = p.parse_args(argv)

    torch.manual_seed(0)
    cfg = LlamaConfig(**PRESETS[args.preset])
    cfg._attn_implementation = register_attention()
    model = LlamaForCausalLM(cfg)
    data = Bigram(cfg.vocab_size, min(64, cfg.max_position_embeddings), n=512)
    overrides = {"flush_every": 10, "sinks__console__every": 1}
    if args.jsonl:
        overrides["sinks__jsonl__path"] = args.jsonl
    callback = NumwatchTrainerCallback(stop_on=["nonfinite"], **overrides)
    with tempfile.TemporaryDirectory() as tmp:
        training = TrainingArguments(
            output_dir=args.output_dir or tmp,
            max_steps=args.steps,
            per_device_train_batch_size=args.batch,
            learning_rate=args.lr,
            lr_scheduler_type="cosine",
            warmup_steps=max(1, args.steps // 10),
            max_grad_norm=1.0,
            bf16=torch.cuda.is_available(),
            logging_steps=10,
            save_strategy="no",
            report_to=[],
            use_cpu=not torch.cuda.is_available(),
        )
        trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=[callback])
        result = trainer.train()
    events = len(callback.monitor.events)
    print(f"final training loss {result.training_loss:.4f}; numwatch events: {events}")
    return result.training_loss


if __name__ == "__main__":
    main()
