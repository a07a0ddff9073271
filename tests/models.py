"""The small model the tests train: everything a real model brings, in miniature.

Tied embeddings, a frozen layer, a BatchNorm (buffers), a branch used only
in some steps, transformer-like blocks (the wrap-policy units), and two
parameter groups.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

VOCAB, WIDTH, SEQ = 37, 16, 6


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.mix = nn.Linear(width, width)
        self.up = nn.Linear(width, 3 * width)
        self.down = nn.Linear(3 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.ln(x))
        return x + self.down(F.gelu(self.up(x)))


class TinyTransformer(nn.Module):
    def __init__(self, blocks: int = 3, width: int = WIDTH, vocab: int = VOCAB, batchnorm: bool = True):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.frozen = nn.Linear(width, width)
        self.frozen.requires_grad_(False)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        # BatchNorm (buffers) by default; LayerNorm where results must not depend on how the batch is split.
        self.norm = nn.BatchNorm1d(width) if batchnorm else nn.GroupNorm(1, width)
        self.branch = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, ids: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        x = self.embed(ids)
        x = x + 0.5 * self.frozen(x)
        # Before the blocks: after the last one, BatchNorm would cancel the
        # last biases, leaving them rounding-noise gradients Adam amplifies.
        x = self.norm(x.transpose(1, 2)).transpose(1, 2)
        for block in self.blocks:
            x = block(x)
        if use_branch:
            x = x + self.branch(x)
        return self.head(x)


class TokenDataset(Dataset):
    """Fixed random token sequences: a dataset without Lightning, so the Accelerate scripts import quickly."""

    def __init__(self, size: int = 96, seed: int = 0):
        self.data = torch.randint(0, VOCAB, (size, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index]


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def param_groups(model: TinyTransformer, lr: float) -> list[dict]:
    """Blocks in one group, everything else trainable in another, with other hyperparameters."""
    block_ids = {id(p) for p in model.blocks.parameters()}
    blocks = [p for p in model.parameters() if id(p) in block_ids]
    rest = [p for p in model.parameters() if id(p) not in block_ids and p.requires_grad]
    return [
        {"params": blocks, "lr": lr, "weight_decay": 0.01},
        {"params": rest, "lr": lr * 0.5, "weight_decay": 0.0},
    ]


def make_optimizer(name: str, model: TinyTransformer, lr: float = 1e-2) -> torch.optim.Optimizer:
    groups = param_groups(model, lr)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr)
    if name == "muon":  # the matrices only (square, tall and wide, and the tied embedding), as torch's docs set it up
        matrices = [dict(group, params=[p for p in group["params"] if p.ndim == 2]) for group in groups]
        return torch.optim.Muon(matrices, lr=lr, momentum=0.9)
    if name == "muon+adamw":  # zero_core.MuonWithAuxAdamW: Muon for the matrices, AdamW for the rest
        from zero_core import MuonWithAuxAdamW

        split = []
        for group in groups:
            matrices = [p for p in group["params"] if p.ndim == 2]
            rest = [p for p in group["params"] if p.ndim != 2]
            split += [dict(group, params=matrices, use_muon=True), dict(group, params=rest, use_muon=False, lr=lr / 4)]
        return MuonWithAuxAdamW(split)
    if name == "deepspeed-muon":  # a DeepSpeed config's "Muon" section, split by name as DeepSpeed's engine does
        from zero_core.deepspeed import build_optimizer

        trainable = [p for p in model.parameters() if p.requires_grad]
        return build_optimizer({"type": "Muon", "params": {"lr": lr / 4, "muon_lr": lr}}, trainable, model=model)
    if name == "adafactor":  # every tensor stepped whole at an owner: its factors and norms read the whole tensor
        return torch.optim.Adafactor(groups, lr=lr)
    if name == "hf-adafactor":  # transformers' Adafactor, as the Hugging Face Trainer's optim="adafactor" builds it
        from transformers.optimization import Adafactor

        return Adafactor(groups, lr=lr, scale_parameter=False, relative_step=False)
    if name == "adamw-fused":  # torch's fused kernel, as the offloaded step picks on the host
        return torch.optim.AdamW(groups, lr=lr, fused=True)
    raise ValueError(name)


def batch(step: int, rank: int, batch_size: int = 4) -> torch.Tensor:
    """Each rank's own batch for ``step``, the same whoever asks."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (batch_size, SEQ), generator=generator)


def uses_branch(step: int) -> bool:
    return step % 3 != 1
