"""DP-SGD's third engine, "fused": per-record clipping in one backward pass, for models that are a chain of layers.

The forward pass is driven by hand through the model's layers (no module hooks): each parametrised layer's input
`a` and output `z` are kept, one `torch.autograd.grad` of the summed per-record losses gives every output gradient
`b = dL/dz` (and computes no weight gradient at all), and the weight gradients are formed here from (a, b):

- each record's squared gradient norm, layer by layer: for a Linear layer on 2-D inputs the weight's is
  ||a_i||^2 * ||b_i||^2 and the bias's ||b_i||^2 (Goodfellow, Efficient per-example gradient computations; the
  "ghost norm" of Li et al.), never materialising a record's gradient; for convolutions and GroupNorm/LayerNorm
  the per-record gradients are small (batch x kernel, batch x channels) and are formed outright;
- the clipping factors c_i = min(1, C / (||g_i|| + 1e-6)) (Opacus' rule);
- the clipped sum as one weighted product per layer, sum_i c_i b_i^T a_i = (c * b)^T a, added straight into a
  flat gradient buffer (Bu et al., Differentially private optimization on large model at small cost: the
  "book-keeping" that spares ghost clipping's second backward pass).

All trainable parameters live in one flat tensor that the layers read through views, so the Gaussian noise is one
draw, straight into the gradient buffer before the clipped sums are added to it (already divided by the expected
batch size), and the site's optimiser (LocalOptimiser, torch's own update functions; every rule it offers is
elementwise) one step over one tensor. Nothing is allocated for the parameters per step.

What it serves (`problem` says why not, with the fix): nn.Sequential and the zoo's mlp and lenet5, whose forward is
their layers in order, built from Linear, Conv1d/Conv2d (groups 1, zero padding), GroupNorm, LayerNorm (and the
zoo's channel LayerNorm) and parameter-free layers that act on each record alone; every parameter trainable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from fedmqtt.training.optimisers import LocalOptimiser
from fedmqtt.training.zoo.common import ChannelLayerNorm
from fedmqtt.training.zoo.lenet import LeNet5
from fedmqtt.training.zoo.mlp import MLP

# Layers without parameters that act on each record alone (no statistic across the batch): called as they are.
_PARAMETER_FREE = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.MaxPool1d, nn.MaxPool2d,
                   nn.AvgPool1d, nn.AvgPool2d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.Flatten, nn.Identity,
                   nn.Dropout)
_WITH_PARAMETERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.GroupNorm, nn.LayerNorm, ChannelLayerNorm)


def _zoo_chain(model: nn.Module) -> list[nn.Module] | None:
    """The layers of a zoo model whose forward is exactly its layers in this order (tests/unit/test_dp_fused.py checks
    each against the model's own forward); None for any other model."""
    if type(model) is MLP:
        return [*model.blocks, model.head]
    if type(model) is LeNet5:
        return [*model.features, *model.classifier, model.head]
    return None


RecordLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (output, labels) -> one loss per record


def _layers(model: nn.Module) -> list[nn.Module] | None:
    """The chain of leaf layers `model`'s forward runs, in order; None when its forward is not known to be one."""
    zoo = _zoo_chain(model)
    if zoo is not None:
        return zoo
    if type(model) is nn.Sequential:
        out: list[nn.Module] = []
        for child in model:
            inner = _layers(child) if list(child.children()) else [child]
            if inner is None:
                return None
            out += inner
        return out
    return None


def problem(model: nn.Module) -> str | None:
    """Why the fused engine cannot train `model`, with the fix; None when it can."""
    layers = _layers(model)
    fix = 'use engine = "auto" (it falls back to torch.func or opacus) or name one of them'
    if layers is None:
        return (f"the fused engine serves nn.Sequential and the zoo's mlp and lenet5 (a forward that is its layers in "
                f"order), not {type(model).__name__}: {fix}")
    odd = sorted({type(m).__name__ for m in layers
                  if type(m) not in _WITH_PARAMETERS and type(m) not in _PARAMETER_FREE})
    if odd:
        return f"the fused engine cannot serve layers {', '.join(odd)}: {fix}"
    if any(getattr(m, "inplace", False) for m in layers):
        return ("the fused engine reads each layer's output as it was computed, and an in-place layer overwrites it: "
                f"build the model with inplace=False, or {fix}")
    convs = [m for m in layers if isinstance(m, nn.Conv1d | nn.Conv2d)]
    if any(m.groups != 1 or m.padding_mode != "zeros" or isinstance(m.padding, str) for m in convs):
        return f"the fused engine serves convolutions with groups 1 and numeric zero padding only: {fix}"
    params = list(model.parameters())
    if not params:
        return f"the fused engine trains parameters, and this model has none: {fix}"
    if any(not p.requires_grad for p in params):
        return f"the fused engine trains every parameter, and this model has frozen ones: {fix}"
    if len({p.dtype for p in params}) > 1 or len({p.device for p in params}) > 1:
        return f"the fused engine needs every parameter of one dtype on one device: {fix}"
    if len({id(p) for p in params}) != sum(1 for m in layers for _ in m.parameters(recurse=False)):
        return f"the fused engine needs each parameter to belong to exactly one layer of the chain: {fix}"
    return None


class _Layer:
    """A parametrised layer of the chain: its forward from the flat parameters' views, and from its kept input and
    output gradient each record's squared gradient norm and the clipped sum."""

    def __init__(self, views: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        self.views, self.grads = views, grads  # weight (and bias): views into the flat parameters and gradient

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, what the gradient step needs of the input)."""
        raise NotImplementedError

    def norms(self, kept: torch.Tensor, b: torch.Tensor, sq: torch.Tensor) -> None:
        """Add each record's squared gradient norm of this layer's parameters to `sq`."""
        raise NotImplementedError

    def clipped_sum(self, coef: torch.Tensor) -> None:
        """Add sum_i coef_i g_i to this layer's slice of the flat gradient (after `norms`)."""
        raise NotImplementedError


class _Linear(_Layer):
    def __init__(self, views: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        super().__init__(views, grads)
        self.a = self.b_t = torch.empty(0)
        self.per_record: torch.Tensor | None = None
        self.weight, self.bias = views[0], views[1] if len(views) > 1 else None

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.linear(h, self.weight, self.bias), h

    def norms(self, kept: torch.Tensor, b: torch.Tensor, sq: torch.Tensor) -> None:
        if kept.ndim == 2:  # one vector per record: the norm of the outer product b_i a_i^T is a product of norms
            self.a, self.b_t, self.per_record = kept, b.t(), None
            a_sq = torch.linalg.vecdot(kept, kept)
            if self.bias is not None:  # ||a_i||^2 ||b_i||^2 + ||b_i||^2
                a_sq.add_(1.0)
            sq.addcmul_(a_sq, torch.linalg.vecdot(b, b))
            return
        # A sequence per record (any rank above 2): its gradient sum_t b_t a_t^T, formed outright
        a3, b3 = kept.flatten(1, -2), b.flatten(1, -2)
        self.per_record = torch.bmm(b3.transpose(1, 2), a3)
        sq.add_(self.per_record.square().sum((1, 2)))
        self.b_t = b3.sum(1).t()
        if self.bias is not None:
            sq.add_(self.b_t.square().sum(0))

    def clipped_sum(self, coef: torch.Tensor) -> None:
        if self.per_record is None:  # sum_i c_i b_i a_i^T = (b^T scaled by c along the records) a
            self.grads[0].addmm_(self.b_t * coef, self.a)
        else:
            self.grads[0].view(-1).addmv_(self.per_record.flatten(1).t(), coef)
        if self.bias is not None:
            self.grads[1].addmv_(self.b_t, coef)


class _Conv(_Layer):
    """Conv1d/Conv2d: each record's weight gradient from one grouped convolution backward, with the batch as the
    groups (measured about twice as fast as unfolding the input and a batched product, on LeNet-5's layers)."""

    def __init__(self, module: nn.Conv1d | nn.Conv2d, views: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        super().__init__(views, grads)
        self.conv = F.conv1d if isinstance(module, nn.Conv1d) else F.conv2d
        self.stride, self.dilation = list(module.stride), list(module.dilation)
        padding = module.padding
        if isinstance(padding, str):  # problem() refuses it: F.conv*'s "same"/"valid" have no fixed padding here
            raise ValueError(f"padding {padding!r}")
        self.padding = list(padding)
        self.no_output_padding = [0] * len(self.stride)
        self.weight_g = torch.empty(0)
        self.bias_g = torch.empty(0)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bias = self.views[1] if len(self.views) > 1 else None
        return self.conv(h, self.views[0], bias, self.stride, self.padding, self.dilation), h

    def norms(self, kept: torch.Tensor, b: torch.Tensor, sq: torch.Tensor) -> None:
        n, w = kept.shape[0], self.views[0]
        # A convolution of one image of n * C_in channels in n groups, whose weight holds each record's own copy:
        # its weight gradient is every record's weight gradient. Only the weight's shape is read.
        stacked = w.new_empty((n * w.shape[0], *w.shape[1:]))
        self.weight_g = torch.ops.aten.convolution_backward(
            b.reshape(1, -1, *b.shape[2:]), kept.reshape(1, -1, *kept.shape[2:]), stacked, None, self.stride,
            self.padding, self.dilation, False, self.no_output_padding, n, [False, True, False])[1].view(n, -1)
        sq.add_(self.weight_g.square().sum(1))
        if len(self.views) > 1:
            self.bias_g = b.flatten(2).sum(2)
            sq.add_(self.bias_g.square().sum(1))

    def clipped_sum(self, coef: torch.Tensor) -> None:
        self.grads[0].view(-1).addmv_(self.weight_g.t(), coef)
        if len(self.views) > 1:
            self.grads[1].addmv_(self.bias_g.t(), coef)


class _Norm(_Layer):
    """GroupNorm or LayerNorm: the normalisation without its affine part, then x_hat * weight + bias by hand, so the
    gradient of the output gives each record's affine gradients, sum of x_hat * b and of b per channel."""

    def __init__(self, module: nn.Module, views: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        super().__init__(views, grads)
        self.group = isinstance(module, nn.GroupNorm)
        self.channel_ln = isinstance(module, ChannelLayerNorm)
        self.eps = float(module.eps)  # type: ignore[arg-type]  # both kinds hold a float eps
        self.groups = int(module.num_groups) if self.group else 0  # type: ignore[arg-type]
        self.shape = tuple(module.normalized_shape) if not self.group else ()  # type: ignore[arg-type]
        self.weight_g = self.bias_g = torch.empty(0)
        # which view is which: GroupNorm/LayerNorm own weight then bias, either possibly absent
        self.has_weight = getattr(module, "weight", None) is not None
        self.has_bias = getattr(module, "bias", None) is not None

    def _affine_shape(self, h: torch.Tensor) -> list[int]:
        return [-1] + [1] * (h.ndim - 2) if self.group else list(self.shape)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.channel_ln:
            h = h.movedim(1, -1)
        xhat = F.group_norm(h, self.groups, eps=self.eps) if self.group else F.layer_norm(h, self.shape, eps=self.eps)
        out = xhat
        i = 0
        if self.has_weight:
            out = out * self.views[0].view(self._affine_shape(h))
            i = 1
        if self.has_bias:
            out = out + self.views[i].view(self._affine_shape(h))
        if self.channel_ln:
            out = out.movedim(-1, 1)
        return out, xhat

    def _per_channel(self, t: torch.Tensor) -> torch.Tensor:
        """(batch, channels): a per-element map summed over everything but the record and the affine axes."""
        if self.group:
            return t.flatten(2).sum(2) if t.ndim > 2 else t
        return t.reshape(t.shape[0], -1, *self.shape).sum(1).flatten(1)

    def norms(self, kept: torch.Tensor, b: torch.Tensor, sq: torch.Tensor) -> None:
        if self.channel_ln:
            b = b.movedim(1, -1)
        if self.has_weight:
            self.weight_g = self._per_channel(kept * b)
            sq.add_(self.weight_g.square().sum(1))
        if self.has_bias:
            self.bias_g = self._per_channel(b)
            sq.add_(self.bias_g.square().sum(1))

    def clipped_sum(self, coef: torch.Tensor) -> None:
        i = 0
        if self.has_weight:
            self.grads[0].view(-1).addmv_(self.weight_g.t(), coef)
            i = 1
        if self.has_bias:
            self.grads[i].view(-1).addmv_(self.bias_g.t(), coef)


class FusedDPSGD:
    """DP-SGD steps on `model` through its chain of layers, over a flat copy of its parameters (`write_back` copies
    them into the model). Built once per round; `problem(model)` must be None."""

    def __init__(self, model: nn.Module, record_loss: RecordLoss, optimiser: Callable[[list[nn.Parameter]],
                 LocalOptimiser], *, max_grad_norm: float, noise_multiplier: float, expected_batch_size: int,
                 generator: torch.Generator) -> None:
        why = problem(model)
        if why:
            raise ValueError(why)
        self.model, self.record_loss = model, record_loss
        params = list(model.parameters())
        self.flat = nn.Parameter(torch.cat([p.detach().reshape(-1) for p in params]))
        self.flat.grad = torch.zeros_like(self.flat)
        base, grad = self.flat.detach(), self.flat.grad
        offsets: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        start = 0
        for p in params:
            end = start + p.numel()
            offsets[id(p)] = (base[start:end].view(p.shape), grad[start:end].view(p.shape))
            start = end
        self.chain: list[_Layer | nn.Module] = []
        for m in _layers(model) or []:
            own = [offsets[id(p)] for p in m.parameters(recurse=False)]
            views, grads = [v for v, _ in own], [g for _, g in own]
            if isinstance(m, nn.Linear):
                self.chain.append(_Linear(views, grads))
            elif isinstance(m, nn.Conv1d | nn.Conv2d):
                self.chain.append(_Conv(m, views, grads))
            elif isinstance(m, nn.GroupNorm | nn.LayerNorm):
                self.chain.append(_Norm(m, views, grads))
            else:
                self.chain.append(m)
        self.layers = [s for s in self.chain if isinstance(s, _Layer)]
        self.optimiser = optimiser([self.flat])
        self.clip, self.std = float(max_grad_norm), float(noise_multiplier) * float(max_grad_norm)
        self.expected_batch_size = float(expected_batch_size)
        self.generator = generator
        self.one = torch.ones((), dtype=torch.float32, device=self.flat.device)  # d(sum of losses) / d(sum): no new one
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.flat.device)  # of the records' losses

    def forward(self, xb: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """The model's output, each parametrised layer's kept input and its output (which the backward reads)."""
        kept: list[torch.Tensor] = []
        outputs: list[torch.Tensor] = []
        h = xb
        for s in self.chain:
            if isinstance(s, _Layer):
                h, k = s.forward(h)
                if not h.requires_grad:  # the first parametrised layer: the graph starts at its output
                    h.requires_grad_(True)
                kept.append(k)  # read under no_grad only: no graph grows from it
                outputs.append(h)
            else:
                h = s(h)
        return h, kept, outputs

    def step(self, xb: torch.Tensor, yb: torch.Tensor) -> int:
        """One DP-SGD step on the batch (possibly empty: then the noise alone); returns its records. Their losses
        are added to `loss_sum`.

        The gradient (sum of clipped gradients + N(0, (sigma C)^2)) / B is built in place: the noise drawn straight
        into it at std sigma C / B, then each layer's clipped sum added with the factors c_i / B. Opacus divides
        the noised sum by B instead; the same values up to rounding, and two passes over the parameters fewer."""
        grad = self.flat.grad
        assert grad is not None
        if self.std > 0:  # grad needs no gradient: no no_grad context for it
            grad.normal_(0.0, self.std / self.expected_batch_size, generator=self.generator)
        else:
            grad.zero_()
        if len(yb):
            out, kept, outputs = self.forward(xb)
            losses = self.record_loss(out.float(), yb)
            output_grads = torch.autograd.grad(losses.sum(), outputs, grad_outputs=self.one)
            with torch.no_grad():
                sq = torch.zeros(len(yb), dtype=grad.dtype, device=grad.device)
                for layer, k, b in zip(self.layers, kept, output_grads, strict=True):
                    layer.norms(k, b, sq)
                # c_i / B = min(1, C / (||g_i|| + 1e-6)) / B, Opacus' factor, with the division by B folded in
                coef = sq.sqrt_().add_(1e-6).reciprocal_().mul_(self.clip / self.expected_batch_size) \
                    .clamp_(max=1.0 / self.expected_batch_size)
                for layer in self.layers:
                    layer.clipped_sum(coef)
                self.loss_sum += losses.sum(dtype=torch.float64)
        self.optimiser.step()
        return len(yb)

    def write_back(self) -> None:
        """Copy the trained parameters into the model."""
        with torch.no_grad():
            start = 0
            for p in self.model.parameters():
                end = start + p.numel()
                p.copy_(self.flat[start:end].view(p.shape))
                start = end


def per_record_factors(model: nn.Module, record_loss: RecordLoss, xb: torch.Tensor, yb: torch.Tensor,
                       max_grad_norm: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each record's gradient norm and the clipped sum {parameter name: tensor} the engine computes for one batch,
    without noise or a step (tests compare both with torch.func's and single-record backward passes)."""
    name_of = {id(p): k for k, p in model.named_parameters()}
    engine = FusedDPSGD(model, record_loss, lambda ps: LocalOptimiser(ps, "sgd", lr=0.0),
                        max_grad_norm=max_grad_norm, noise_multiplier=0.0, expected_batch_size=1,
                        generator=torch.Generator())
    assert engine.flat.grad is not None
    engine.flat.grad.zero_()
    out, kept, outputs = engine.forward(xb)
    grads = torch.autograd.grad(record_loss(out.float(), yb).sum(), outputs)
    with torch.no_grad():
        sq = torch.zeros(len(yb))
        for layer, k, b in zip(engine.layers, kept, grads, strict=True):
            layer.norms(k, b, sq)
        norms = sq.sqrt()
        coef = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
        for layer in engine.layers:
            layer.clipped_sum(coef)
    summed: dict[str, torch.Tensor] = {}
    start = 0
    for p in model.parameters():
        end = start + p.numel()
        summed[name_of[id(p)]] = engine.flat.grad[start:end].view(p.shape).clone()
        start = end
    return norms, summed


def accountant_history(history: Sequence[tuple[float, float, int]], sigma: float, q: float, steps: int
                       ) -> list[tuple[float, float, int]]:
    """`history` after `steps` more steps at (sigma, q), as Opacus' accountants record them one step at a time
    (a step of the same noise and rate as the last entry extends it)."""
    out = [(float(s), float(r), int(n)) for s, r, n in history]
    if steps <= 0:
        return out
    if out and out[-1][:2] == (sigma, q):
        out[-1] = (sigma, q, out[-1][2] + steps)
    else:
        out.append((sigma, q, steps))
    return out
