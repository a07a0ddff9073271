"""A small GPT-style language model (tied embeddings, pre-norm blocks) and a
synthetic token stream, shared by the examples and the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 512
    seq_len: int = 64
    width: int = 128
    depth: int = 4
    heads: int = 4


class GPTBlock(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.heads = config.heads
        self.ln_attn = nn.LayerNorm(config.width)
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.proj = nn.Linear(config.width, config.width)
        self.ln_mlp = nn.LayerNorm(config.width)
        self.up = nn.Linear(config.width, 4 * config.width)
        self.down = nn.Linear(4 * config.width, config.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.ln_attn(x)).view(batch, seq, 3, self.heads, -1).transpose(1, 3).unbind(2)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, width))
        return x + self.down(F.gelu(self.up(self.ln_mlp(x))))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.width)
        self.position = nn.Parameter(torch.zeros(config.seq_len, config.width))
        self.blocks = nn.ModuleList(GPTBlock(config) for _ in range(config.depth))
        self.ln_final = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """This module's own initialisation (children initialise themselves first)."""
        nn.init.normal_(self.embed.weight, std=0.02)  # N(0, 1) would make the tied logits huge
        nn.init.zeros_(self.position)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.position[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_final(x))


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def synthetic_batch(config: GPTConfig, batch_size: int, step: int, rank: int) -> torch.Tensor:
    """A learnable stream: each sequence counts up from a random start (mod vocab)."""
    generator = torch.Generator().manual_seed(step * 7919 + rank)
    start = torch.randint(0, config.vocab_size, (batch_size, 1), generator=generator)
    return (start + torch.arange(config.seq_len)) % config.vocab_size
