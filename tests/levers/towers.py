"""The small models the levers' tests share: a tower of same-type residual blocks (what checkpointing finds), its
gradients from a seed, and their comparison at the levers' tolerance."""

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.linear, self.dropout = nn.Linear(width, width), nn.Dropout(dropout)

    def forward(self, x):
        return x + self.dropout(torch.tanh(self.linear(x)))


class Tower(nn.Module):
    def __init__(self, width=16, depth=4, dropout=0.0):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(3, width)
        self.blocks = nn.ModuleList(Block(width, dropout) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def grads(model, x, seed=1):
    model.zero_grad()
    torch.manual_seed(seed)
    model(x).pow(2).mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def assert_close(got, expected):
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7)
