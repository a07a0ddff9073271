"""A tiny Llama-style model and the tensor-parallel plan torch's tutorial gives Llama (torchtitan's):
rotary-free attention with heads split column-wise, a SwiGLU feed-forward, RMSNorms sequence-parallel.

The same class runs unsplit (the one-process reference) and split by ``parallelize`` (each module then
sees its local heads and columns: shapes are read from the tensors, never from the config).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

VOCAB, WIDTH, HEADS, HIDDEN, SEQUENCE = 64, 32, 4, 64, 8


@dataclass(frozen=True)
class LlamaSize:
    vocab: int = VOCAB
    width: int = WIDTH
    heads: int = HEADS
    hidden: int = HIDDEN
    layers: int = 2


class Attention(nn.Module):
    def __init__(self, size: LlamaSize) -> None:
        super().__init__()
        self.head_dim = size.width // size.heads
        self.wq, self.wk, self.wv = (nn.Linear(size.width, size.width, bias=False) for _ in range(3))
        self.wo = nn.Linear(size.width, size.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, sequence, _ = x.shape
        head_dim = self.head_dim

        def heads(t: torch.Tensor) -> torch.Tensor:  # (B, S, local width) -> (B, local heads, S, head_dim)
            return t.view(batch, sequence, -1, head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x)), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, sequence, -1))


class FeedForward(nn.Module):
    def __init__(self, size: LlamaSize) -> None:
        super().__init__()
        self.w1 = nn.Linear(size.width, size.hidden, bias=False)
        self.w3 = nn.Linear(size.width, size.hidden, bias=False)
        self.w2 = nn.Linear(size.hidden, size.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Layer(nn.Module):
    def __init__(self, size: LlamaSize) -> None:
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(size.width), Attention(size)
        self.ffn_norm, self.feed_forward = nn.RMSNorm(size.width), FeedForward(size)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attention(self.attention_norm(h))
        return h + self.feed_forward(self.ffn_norm(h))


class TinyLlama(nn.Module):
    def __init__(self, size: LlamaSize = LlamaSize()) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(size.vocab, size.width)
        self.layers = nn.ModuleList(Layer(size) for _ in range(size.layers))
        self.norm = nn.RMSNorm(size.width)
        self.output = nn.Linear(size.width, size.vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(ids)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def parallelize(model: TinyLlama, tp_mesh: DeviceMesh, sequence_parallel: bool = True) -> TinyLlama:
    """Split every layer across ``tp_mesh`` (Megatron-style, with sequence parallelism between them unless
    ``sequence_parallel=False``: then every layer's input is whole on every rank, as in the ZeRO paper)."""
    if not sequence_parallel:
        return _parallelize_without_sequence_parallelism(model, tp_mesh)
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for layer in model.layers:
        parallelize_module(
            layer,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            },
        )
    return model


def _parallelize_without_sequence_parallelism(model: TinyLlama, tp_mesh: DeviceMesh) -> TinyLlama:
    """Megatron's plan: the norms are whole on every rank, the row-wise linears all-reduce their outputs."""
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    for layer in model.layers:
        parallelize_module(
            layer,
            tp_mesh,
            {
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
            },
        )
    return model


def tokens(step: int, dp_rank: int, batch_size: int = 2) -> torch.Tensor:
    """Data-parallel rank ``dp_rank``'s micro-batch ``step``: the tensor-parallel ranks of one group share it."""
    generator = torch.Generator().manual_seed(1000 * step + dp_rank)
    return torch.randint(0, VOCAB, (batch_size, SEQUENCE), generator=generator)


def loss_of(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].reshape(-1))
