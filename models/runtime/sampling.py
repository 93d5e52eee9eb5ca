"""Choosing the next token from the logits: greedy, or sampled with a seed (temperature, top-k)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy (argmax); otherwise softmax(logits / temperature) over the top_k
    (all when None), drawn from a generator seeded with `seed`, so a run is reproducible."""

    temperature: float = 0.0
    top_k: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0 or self.temperature != self.temperature:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self, device: torch.device) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(self.seed)


def next_tokens(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """logits: [B, V] -> next token ids [B] (int64)."""
    logits = logits.float()
    if sampling.greedy:
        return logits.argmax(-1)
    z = logits / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < z.shape[-1]:
        kth = z.topk(sampling.top_k, dim=-1).values[:, -1:]  # [B, 1]
        z = z.masked_fill(z < kth, float("-inf"))
    probs = torch.softmax(z, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
