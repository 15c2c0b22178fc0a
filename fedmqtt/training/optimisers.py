"""The site's local optimisers: torch.optim's own update functions, driven without torch.optim's classes.

Why not `torch.optim.SGD`/`Adam`/`AdamW` themselves: in torch 2.13 building any of them (`add_param_group`)
and every `step()` and `zero_grad()` import `torch._dynamo`, only to insert graph breaks for `torch.compile`,
which a site never uses. That import costs about 0.8 CPU s and 70 MB in every site process, in round 1.
The arithmetic stays torch's: `step()` calls the functional kernels the classes call
(`torch.optim.sgd.sgd`, `torch.optim.adam.adam`) with the same arguments and the same per-parameter state,
so the weights are bit-identical to the classes' (tests/unit/test_optimisers.py compares them).
A new optimiser is built for every local training call (state never outlives a round), so there is no
state_dict to save or load.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.optim.adam import adam
from torch.optim.sgd import sgd

KINDS = ("sgd", "adam", "adamw")
NAMES = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}
ADAM_BETAS = (0.9, 0.999)  # torch.optim.Adam's defaults, as the classes were used before
ADAM_EPS = 1e-8


class LocalOptimiser:
    """SGD (momentum, Nesterov, weight decay), Adam or AdamW over `params`, as torch.optim computes them."""

    def __init__(self, params: list[nn.Parameter], kind: str, *, lr: float, weight_decay: float = 0.0,
                 momentum: float = 0.0, nesterov: bool = False) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown optimiser {kind!r}; one of {', '.join(KINDS)}")
        if not (lr >= 0.0 and weight_decay >= 0.0 and momentum >= 0.0):
            raise ValueError(f"lr, weight_decay and momentum must be >= 0 (got {lr}, {weight_decay}, {momentum})")
        if nesterov and (kind != "sgd" or momentum <= 0.0):
            raise ValueError("Nesterov momentum needs SGD with momentum > 0")
        self.kind = kind
        self.name = NAMES[kind]
        self.params = list(params)
        self.defaults: dict[str, Any] = {"lr": lr, "weight_decay": weight_decay}
        if kind == "sgd":
            self.defaults.update(momentum=momentum, nesterov=nesterov, dampening=0.0)
        else:
            self.defaults.update(betas=ADAM_BETAS, eps=ADAM_EPS)
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        # On the CPU torch.optim always takes the per-tensor loop (its multi-tensor kernels are for GPUs); saying
        # so skips the choice it would make again at every step (about 3 % of a small model's local round).
        # Anywhere else torch chooses, as the classes do.
        self._foreach: bool | None = False if all(p.device.type == "cpu" for p in self.params) else None

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        with_grad = [(p, g) for p in self.params if (g := p.grad) is not None]
        live: list[torch.Tensor] = [p for p, _ in with_grad]
        grads = [g for _, g in with_grad]
        if any(g.is_sparse for g in grads):
            raise RuntimeError("the local optimisers take dense gradients only")
        if self.kind == "sgd":
            self._sgd(live, grads)
        else:
            self._adam(live, grads)

    def _sgd(self, live: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        d = self.defaults
        buffers = [self.state.get(p, {}).get("momentum_buffer") for p in live] if d["momentum"] else []
        sgd(live, grads, buffers, foreach=self._foreach, weight_decay=d["weight_decay"], momentum=d["momentum"],
            lr=d["lr"], dampening=d["dampening"], nesterov=d["nesterov"], maximize=False)
        # sgd() creates the buffers on the first step; without momentum there are none (`buffers` is empty)
        for p, buf in zip(live, buffers, strict=False):
            if buf is not None:
                self.state.setdefault(p, {})["momentum_buffer"] = buf

    def _adam(self, live: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        d = self.defaults
        for p in live:
            if p not in self.state:  # as torch.optim.Adam._init_group (not capturable, not fused)
                self.state[p] = {"step": torch.tensor(0.0, dtype=_scalar_dtype(), device="cpu"),
                                 "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                 "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        state = [self.state[p] for p in live]
        adam(live, grads, [s["exp_avg"] for s in state], [s["exp_avg_sq"] for s in state], [],
             [s["step"] for s in state], foreach=self._foreach, has_complex=any(torch.is_complex(p) for p in live),
             decoupled_weight_decay=self.kind == "adamw", amsgrad=False, beta1=ADAM_BETAS[0], beta2=ADAM_BETAS[1],
             lr=d["lr"], weight_decay=d["weight_decay"], eps=ADAM_EPS, maximize=False)


def _scalar_dtype() -> torch.dtype:
    """The dtype torch.optim keeps Adam's step count in (float64 only under a float64 default dtype)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
