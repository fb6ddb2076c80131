"""SAM's tower and its training pass, with the gradients written out.

A tower is ``in -> hidden (tanh, dropout) -> out (tanh) -> L2 normalised``. Training runs
:meth:`Tower.train_forward`, which keeps what the backward pass reads, and
:meth:`Tower.set_gradients`, which writes each parameter's ``.grad`` from the gradient of the
loss with respect to the tower's output. The backward pass is the chain rule of the forward
pass, written out so that it runs as a handful of large operations: the biases are added by the
matrix products (``addmm``), the nonlinearities run in place, and the dropout multipliers of
the forward pass are reused. It computes the same gradients as autograd over the same forward
pass (``tests/test_sam.py``), rounded in a different order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from streamxm.models.work import Work, elementwise, gemm

__all__ = ["Tower", "TowerPass", "dropout_multipliers", "step_multipliers"]

_NET = 4  # itemsize of the towers, their inputs and activations: float32
#: Bits of each unit's dropout draw (a 63-bit word from the generator gives four of them).
_DROPOUT_BITS = 15


def dropout_multipliers(
    shape: tuple[int, int], rate: float, generator: torch.Generator, device: torch.device
) -> Tensor:
    """Inverted dropout's multipliers: ``1 / (1 - rate)`` for a kept unit, 0 for a dropped one.

    Each unit draws :data:`_DROPOUT_BITS` uniform bits (four units share a 63-bit word of
    ``generator``: one draw from it per four units) and is dropped when they are below
    ``round(rate * 2**15)``, so the rate is applied to within ``2**-16``.

    >>> g = torch.Generator().manual_seed(0)
    >>> m = dropout_multipliers((500, 400), 0.3, g, torch.device("cpu"))
    >>> sorted(set(m.unique().tolist())) == [0.0, float(torch.tensor(1 / 0.7))]
    True
    >>> round(float((m == 0).float().mean()), 2)
    0.3
    """
    units = shape[0] * shape[1]
    words = torch.empty((units + 3) // 4, dtype=torch.int64, device=device)
    words.random_(generator=generator)  # uniform over [0, 2**63)
    lanes = words.view(torch.int16)[:units].view(shape)
    threshold = round(rate * 2**_DROPOUT_BITS)
    # in place on the int16 lanes, then one conversion: torch.where here is several times slower
    keep = lanes.bitwise_and(2**_DROPOUT_BITS - 1).ge_(threshold)
    return keep.to(torch.float32).mul_(1.0 / (1.0 - rate))


def step_multipliers(
    shape: tuple[int, int],
    rate: float,
    generator: torch.Generator,
    device_generator: torch.Generator | None,
    device: torch.device,
) -> Tensor | None:
    """One tower's dropout multipliers for a training step (``None`` at ``rate`` 0).

    They are drawn from ``generator`` where it is on ``device`` (``device_generator`` is
    ``None``); on another device, from ``device_generator`` seeded by one draw from
    ``generator``, so the model's randomness stays in one CPU generator whatever the device.
    """
    if rate == 0:
        return None
    if device_generator is not None:
        seed = int(torch.randint(2**62, (1,), generator=generator))
        generator = device_generator.manual_seed(seed)
    return dropout_multipliers(shape, rate, generator, device)


@dataclass
class TowerPass:
    """A training forward pass: its input, activations and output, as the backward reads them.

    ``hidden`` is ``tanh(x W1 + b1)``, ``dropped`` the hidden layer after dropout (``hidden``
    itself without dropout), ``out`` is ``tanh(dropped W2 + b2)``, ``norm`` its row norms and
    ``z = out / norm`` the tower's output.
    """

    x: Tensor
    hidden: Tensor
    multipliers: Tensor | None
    dropped: Tensor
    out: Tensor
    norm: Tensor
    z: Tensor


class Tower(nn.Module):
    """``in -> hidden (tanh, dropout) -> out (tanh) -> L2 normalised``.

    The dropout multipliers are drawn by the caller from the model's own generator
    (:func:`dropout_multipliers`), so the model's randomness is its own (and checkpointed), not
    torch's global state. The weights live on ``device``.
    """

    def __init__(
        self, in_dim: int, hidden: int, out_dim: int, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.zeros(in_dim, hidden, device=device))
        self.b1 = nn.Parameter(torch.zeros(hidden, device=device))
        self.w2 = nn.Parameter(torch.zeros(hidden, out_dim, device=device))
        self.b2 = nn.Parameter(torch.zeros(out_dim, device=device))

    def reset(self, generator: torch.Generator) -> None:
        """Glorot-uniform weights, zero biases (the Keras defaults the paper's code used).

        The weights are drawn on the generator's device (a CPU generator gives the same weights
        whatever device the tower is on) and copied to the tower's.
        """
        with torch.no_grad():
            for w in (self.w1, self.w2):
                bound = math.sqrt(6.0 / (w.shape[0] + w.shape[1]))
                if w.device == generator.device:
                    w.uniform_(-bound, bound, generator=generator)
                else:
                    drawn = torch.empty(w.shape, device=generator.device)
                    w.copy_(drawn.uniform_(-bound, bound, generator=generator))
            self.b1.zero_()
            self.b2.zero_()

    def forward(self, x: Tensor) -> Tensor:
        """The inference pass: :meth:`train_forward`'s output without dropout."""
        return self.train_forward(x, None).z

    @torch.no_grad()
    def train_forward(self, x: Tensor, multipliers: Tensor | None) -> TowerPass:
        """The training pass, dropout applied by ``multipliers`` (``None``: no dropout)."""
        hidden = torch.addmm(self.b1, x, self.w1).tanh_()
        dropped = hidden if multipliers is None else hidden * multipliers
        out = torch.addmm(self.b2, dropped, self.w2).tanh_()
        # F.normalize's rule: a norm below 1e-12 divides by 1e-12
        norm = torch.linalg.vector_norm(out, dim=1, keepdim=True).clamp_min_(1e-12)
        return TowerPass(x, hidden, multipliers, dropped, out, norm, out / norm)

    @torch.no_grad()
    def set_gradients(self, p: TowerPass, grad_z: Tensor) -> None:
        """Each parameter's ``.grad`` from ``grad_z``, the loss's gradient at ``p.z``.

        With ``z = o / |o|``: ``dL/do = (g - z (g . z)) / |o|``; through ``tanh``: times ``1 -
        o^2``; ``dL/dW2 = dropped^T g2``, ``dL/db2`` its column sums; back through ``W2``, the
        dropout multipliers and ``1 - hidden^2``: ``g1``; ``dL/dW1 = x^T g1``. (Where a norm
        was clamped at 1e-12 the exact gradient has no ``z (g . z)`` term; tanh outputs of a
        normal width are never that small.)
        """
        one = torch.ones((), device=grad_z.device)
        g = torch.addcmul(grad_z, p.z, (grad_z * p.z).sum(dim=1, keepdim=True), value=-1.0)
        g.div_(p.norm).mul_(torch.addcmul(one, p.out, p.out, value=-1.0))
        self.w2.grad = p.dropped.T @ g
        self.b2.grad = g.sum(dim=0)
        g = g @ self.w2.T
        if p.multipliers is not None:
            g.mul_(p.multipliers)
        g.mul_(torch.addcmul(one, p.hidden, p.hidden, value=-1.0))
        self.w1.grad = p.x.T @ g
        self.b1.grad = g.sum(dim=0)


#: Float32 passes over the (b, hidden) activations of a training forward and backward pass:
#: forward tanh 2, dropout multipliers (drawn as a quarter of the items in 8-byte words: 0.5,
#: lanes masked and compared 2 x 0.75, multipliers written 1) 3, applied 3; backward through
#: the multipliers 3, ``1 - h^2`` 4, applied 3, bias sum 1.
_HIDDEN_PASSES = 19.0
#: The same over the (b, dim) outputs: tanh 2, norm 1, normalise 3; backward: ``g . z`` 3,
#: ``g - z (g . z)`` 3, divide 2, ``1 - o^2`` 4, applied 3, bias sum 1.
_OUTPUT_PASSES = 22.0


def tower_training_work(rows: int, in_dim: int, hidden: int, dim: int) -> Work:
    """One tower's training pass over ``rows`` rows ``r``, float32: forward ``x W1`` and ``h
    W2`` (``2 r (in h + h d)`` flops), backward ``x^T g1``, ``h^T g2`` and ``g2 W2^T`` (``2 r
    in h + 4 r h d``: the inputs need no gradient), and the elementwise passes over the
    ``r x h`` activations and ``r x d`` outputs (dropout, tanh, normalisation, both ways)."""
    return (
        gemm(rows, hidden, in_dim, _NET)
        + gemm(rows, dim, hidden, _NET)
        + gemm(in_dim, hidden, rows, _NET)
        + gemm(hidden, dim, rows, _NET)
        + gemm(rows, hidden, dim, _NET)
        + elementwise(rows * hidden, _NET, flops_per_item=8.0, passes=_HIDDEN_PASSES)
        + elementwise(rows * dim, _NET, flops_per_item=12.0, passes=_OUTPUT_PASSES)
    )


def tower_forward_work(rows: int, in_dim: int, hidden: int, dim: int) -> Work:
    """An inference pass: ``x W1`` and ``h W2`` (``2 r (in h + h d)`` flops, the biases added
    by the products), tanh in place on the ``r x h`` activations (2 passes), tanh and
    normalisation on the ``r x d`` outputs (5 passes) and their copy out (2)."""
    return (
        gemm(rows, hidden, in_dim, _NET)
        + gemm(rows, dim, hidden, _NET)
        + elementwise(rows * hidden, _NET, flops_per_item=1.0, passes=2.0)
        + elementwise(rows * dim, _NET, flops_per_item=4.0, passes=7.0)
    )
