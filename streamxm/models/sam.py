"""SAM: two towers trained on bi-directional triplets with a scheduled adaptive margin.

Semedo and Magalhaes, "Cross-Modal Subspace Learning with Scheduled Adaptive Margin
Constraints", ACM MM 2019. The margin arithmetic (Eq. 6-10) is in the module-level functions,
so it can be checked by hand; :class:`SAM` is the model.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor, nn

from streamxm.buffer.replay import ReplayBuffer, label_tuples
from streamxm.models.base import Arrays, LearnStats, MergeParts, require
from streamxm.models.classes import ClassIndex
from streamxm.models.moments import FeatureScaler, power_normalize
from streamxm.models.opt_in import CountsWork, MergesRanks
from streamxm.models.optim import nesterov_step, nesterov_work
from streamxm.models.sam_tower import (
    Tower,
    dropout_multipliers,
    tower_forward_work,
    tower_training_work,
)
from streamxm.models.work import Work, elementwise, gemm
from streamxm.stream.messages import Pair, make_pair

__all__ = [
    "SAM",
    "Tower",
    "batch_loss",
    "centroid_margin",
    "pairwise_distances",
    "schedule_alpha",
    "score_gradient",
    "semantic_margin",
]

_EMBED_ROWS = 4096  # rows per forward pass when embedding: bounds the hidden activations


def schedule_alpha(t: float, k: float, f_a: float, n_e: float) -> float:
    """Eq. 7: ``alpha(t) = 1 / (1 + exp(-k (t - f_a n_e)))``, the weight of the adaptive margin.

    >>> round(schedule_alpha(40, k=0.1, f_a=0.4, n_e=100), 6)
    0.5
    >>> round(schedule_alpha(0, k=0.1, f_a=0.4, n_e=100), 6)
    0.017986
    """
    return 1.0 / (1.0 + math.exp(-k * (t - f_a * n_e)))


def semantic_margin(
    dist_img: Tensor, dist_txt: Tensor, scale_img: float, scale_txt: float
) -> Tensor:
    """``f_ms`` (Eq. 9): the mean over both modalities of the input-space distance between
    anchor and negative, each divided by its modality's largest distance (``scale_*``) and
    clipped to [0, 1].

    >>> semantic_margin(torch.tensor([1.0, 4.0]), torch.tensor([0.5, 0.5]), 2.0, 1.0)
    tensor([0.5000, 0.7500])
    """
    a = (dist_img / max(scale_img, 1e-12)).clamp(0.0, 1.0)
    b = (dist_txt / max(scale_txt, 1e-12)).clamp(0.0, 1.0)
    return 0.5 * (a + b)


def centroid_margin(cent_img: Tensor, cent_txt: Tensor) -> Tensor:
    """``f_mc`` (Eq. 10) for every pair of rows: half the sum, over the two modalities, of the
    cosine distance between the rows' category centroids, the cosine mapped to [0, 1] first
    (distance ``(1 - cos) / 2``).

    >>> c = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    >>> centroid_margin(c, c)[0]
    tensor([0.0000, 0.5000, 1.0000])
    """

    def cosine_distance(c: Tensor) -> Tensor:
        u = nn.functional.normalize(c, dim=1)
        return (1.0 - u @ u.T) / 2.0

    return 0.5 * (cosine_distance(cent_img) + cosine_distance(cent_txt))


def batch_loss(s: Tensor, margins: Tensor, negatives: Tensor) -> tuple[Tensor, Tensor]:
    """Eq. 5 over a mini-batch: per anchor, the hinge summed over its negatives, both directions.

    ``s[i, j]`` is the similarity of image ``i`` and text ``j`` (pair ``i``'s partner is text
    ``i``), ``margins[a, n]`` the margin of anchor ``a`` against negative ``n`` and
    ``negatives[a, n]`` whether ``n`` is a negative of ``a``. Returns the hinge terms of the
    image anchors (against texts) and of the text anchors (against images), each (b, b), zero
    off the negatives; the loss is their sum divided by the batch size (the mean over anchors
    of the per-anchor sum: the plain sum diverges at the paper's learning rate).
    """
    pos = torch.diagonal(s)[:, None]
    mask = negatives.to(s.dtype)
    i2t = torch.relu(margins - pos + s) * mask
    t2i = torch.relu(margins - pos + s.T) * mask
    return i2t, t2i


def score_gradient(i2t: Tensor, t2i: Tensor) -> Tensor:
    """The gradient of :func:`batch_loss`'s loss ``(sum(i2t) + sum(t2i)) / b`` with respect to
    the scores ``s``: with ``A = [i2t > 0]`` and ``B = [t2i > 0]`` (the active hinges, zero off
    the negatives), ``(A + B^T - diag(rowsum(A) + rowsum(B))) / b``; a hinge at exactly zero
    passes no gradient, as ``relu``'s.

    >>> score_gradient(torch.tensor([[0.0, 0.2], [0.0, 0.0]]), torch.zeros(2, 2))
    tensor([[-0.5000,  0.5000],
            [ 0.0000,  0.0000]])
    """
    active_i2t = (i2t > 0).to(i2t.dtype)
    active_t2i = (t2i > 0).to(t2i.dtype)
    grad = active_i2t + active_t2i.T
    grad.diagonal().sub_(active_i2t.sum(dim=1) + active_t2i.sum(dim=1))
    return grad.div_(i2t.shape[0])


# -- the work counted (streamxm/models/work.py) ------------------------------------------------
_NET = 4  # itemsize of the towers, their inputs, margins and optimiser state: float32
#: Float32 passes over a (b, b) matrix: the margins (Eq. 6-10), the two hinges (Eq. 5), their
#: backward, the negatives and the statistics of :meth:`SAM._record` (an estimate of ~100
#: elementwise torch ops, each reading or writing one (b, b) array).
_PAIRWISE_PASSES, _PAIRWISE_FLOPS = 100.0, 40.0
#: Float32 passes over the (b, classes) category matrix: its zero fill, four row or column sums
#: and the per-item normalisation (read and written).
_CATEGORY_PASSES = 7.0


def _prepare_work(rows: int, dim: int, power: float | None) -> Work:
    """Inputs before a tower (:meth:`SAM._prepare`), float32: when ``power`` is set, the
    absolute value (8 B per item), its power (8; none at ``power = 1``), the sign (8) and the
    product (12), the row norms (4) and the division (8); then the standardisation, subtract
    (12) and divide (8)."""
    n = float(rows) * dim
    prepare = Work(2.0 * n, 20.0 * n, 2.0 * n)
    if power is None:
        return prepare
    mapped = 5.0 * n if power != 1.0 else 4.0 * n
    return prepare + Work(mapped, (48.0 if power != 1.0 else 40.0) * n, mapped)


@contextmanager
def _subnormals_flushed() -> Iterator[None]:
    """This thread's floating-point unit flushes subnormal results and inputs to zero (x86
    FTZ/DAZ, ``torch.set_flush_denormal``) inside the block, and stops after it.

    Where the hinges go quiet (every margin met, as on well-separated classes), gradients are
    exactly zero and the momentum decays geometrically into subnormal numbers, whose arithmetic
    runs much slower on x86. Values that small move no weight. The mode is per thread, so other
    threads (the API's embedding) keep IEEE arithmetic; a caller that had it on finds it off
    afterwards.
    """
    flushing = torch.set_flush_denormal(True)  # False where the CPU has no such mode
    try:
        yield
    finally:
        if flushing:
            torch.set_flush_denormal(False)


def _resolve_device(device: str) -> torch.device:
    """The torch device of SAM's ``device`` parameter (see :class:`SAM`).

    >>> _resolve_device("cpu")
    device(type='cpu')
    >>> _resolve_device("gpu")
    Traceback (most recent call last):
    ...
    ValueError: device must be 'auto', 'cpu' or 'cuda', got 'gpu'
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    cuda = torch.cuda.is_available()
    if device == "cuda" and not cuda:
        raise ValueError(
            "device must be 'auto' or 'cpu' where torch finds no CUDA device "
            "(torch.cuda.is_available() is False), got 'cuda'"
        )
    return torch.device("cuda" if device == "cuda" or (device == "auto" and cuda) else "cpu")


def pairwise_distances(x: Tensor) -> Tensor:
    """Euclidean distances between the rows of ``x``, from their Gram matrix: ``d_ij^2 =
    |x_i|^2 + |x_j|^2 - 2 x_i . x_j``, clipped at 0 (the product path ``torch.cdist`` takes for
    more than 25 rows, without its padded copies of the operands; the diagonal is exactly 0).

    >>> pairwise_distances(torch.tensor([[0.0, 0.0], [3.0, 4.0]]))
    tensor([[0., 5.],
            [5., 0.]])
    """
    gram = x @ x.T
    norms = gram.diagonal().clone()
    return gram.mul_(-2.0).add_(norms[:, None]).add_(norms[None, :]).clamp_min_(0.0).sqrt_()


def _distance_work(rows: int, dim: int) -> Work:
    """:func:`pairwise_distances` of ``r`` rows: the ``r x r x d`` product and five passes over
    the ``r x r`` result (scale, two norm additions, clip, square root, each read and
    written)."""
    return gemm(rows, rows, dim, _NET) + elementwise(
        rows * rows, _NET, flops_per_item=5.0, passes=10.0
    )


class SAM(CountsWork, MergesRanks, name="sam", shared_space=True, batch_fit=True):
    """Two towers into a shared ``dim``-space, trained with the scheduled adaptive margin.

    Each tower is ``in -> hidden -> dim`` with tanh after each layer and L2-normalised outputs;
    the score is the cosine. SGD with Nesterov momentum minimises Eq. 5's bi-directional
    triplet hinge with the margin ``f_m = alpha(t) f_am + (1 - alpha(t)) m``,
    ``f_am = lam f_ms + (1 - lam) f_mc`` (:func:`schedule_alpha`, :func:`semantic_margin`,
    :func:`centroid_margin`). On a stream each step takes the newly arrived pairs, filled up to
    a mini-batch from a reservoir sample of the stream.

    See ``docs/design.md``, section "sam", for the method and the streaming choices.

    Parameters
    ----------
    img_dim, txt_dim : int
        Input sizes.
    dim : int, default=200
        Output size (the shared space), ``>= 1``.
    hidden : int, default=1024
        Hidden width, ``>= 1``.
    dropout : float, default=0.3
        Dropout rate on the hidden layer, in ``[0, 1)`` (the paper: 0.1); chosen on the
        Wikipedia data (``docs/benchmarks.md``).
    lr : float, default=5e-3
        SGD learning rate, ``> 0``.
    momentum : float, default=0.9
        Nesterov momentum, in ``[0, 1)``.
    decay : float, default=1e-6
        Learning-rate decay, ``lr_t = lr / (1 + decay * step)``, ``>= 0``.
    batch_size : int, default=200
        Mini-batch size, ``>= 2``.
    lam : float, default=0.25
        Weight of ``f_ms`` in ``f_am``, in ``[0, 1]``.
    f_a : float, default=0.4
        Eq. 7's ``f_a``: ``alpha(t)`` is one half at ``t = f_a n_e``.
    k : float, default=0.1
        Eq. 7's slope ``k``.
    n_e : float, default=100.0
        Eq. 7's ``n_e``, in the clock's unit (epochs, or epoch-equivalents on a stream).
    margin : float, default=1.0
        The static margin ``m``.
    alpha : float or None, default=None
        A fixed ``alpha`` in ``[0, 1]`` instead of the schedule (the paper's ablations: 0 =
        static margin).
    epochs : int, default=100
        Offline passes, ``>= 0``.
    epoch_pairs : int, default=2000
        The clock's unit on a stream: rows of gradient work per epoch-equivalent, ``>= 1``.
    step_every : int, default=2
        New pairs per step on a stream, from 1 to ``batch_size``.
    replay : int, default=5000
        Size of the reservoir the mini-batches are filled from, ``>= batch_size``.
    centroid_rate : float, default=0.1
        Weight of a mini-batch's class means in the centroids, in ``(0, 1]``.
    max_classes : int, default=1000
        Classes with a centroid (labels beyond are ignored).
    power_img : float or None, default=0.5
        Image row power map before L2 normalisation and standardisation (``None``: none, the
        paper's setting); chosen on the Wikipedia data (``docs/benchmarks.md``).
    power_txt : float or None, default=None
        Text row power map before L2 normalisation and standardisation (``None``: none).
    balance : bool, default=True
        During a burst of few classes, fill mini-batches class-balanced from the reservoir.
    scale_pairs : int or None, default=300
        Pairs the input standardisation learns from on a stream, ``>= 1`` (``None``: every pair).
    device : {"auto", "cpu", "cuda"}, default="auto"
        Where the towers, the optimiser state, the centroids and every tensor of a step live:
        ``"auto"`` (CUDA when ``torch.cuda.is_available()``, else the CPU), ``"cpu"`` or
        ``"cuda"`` (a ``ValueError`` on a machine without CUDA). The numpy interfaces
        (embeddings, similarity, :meth:`state`, :meth:`load_state`) take and return CPU arrays
        whatever it is; :meth:`params` records ``"cuda"`` as ``"auto"``, so a checkpoint
        resolves its device again on the machine that restores it.

    Attributes
    ----------
    device_ : torch.device
        The resolved device.
    img_tower, txt_tower : Tower
        The two towers.
    img_scaler, txt_scaler : FeatureScaler
        The inputs' standardisation statistics.
    cent_img, cent_txt : Tensor of shape (n_classes, dim)
        Per class, the exponentially weighted mean projection of each modality.
    reservoir : ReplayBuffer
        The uniform reservoir sample of the stream that fills the mini-batches.
    pending : list of Pair
        Arrived pairs waiting for the next step.
    steps : int
        SGD steps taken.
    clock : float
        ``t`` of Eq. 7: epochs (offline) or epoch-equivalents (stream) learned.

    References
    ----------
    .. [1] Semedo and Magalhaes, "Cross-Modal Subspace Learning with Scheduled Adaptive Margin
       Constraints", ACM MM 2019.

    Examples
    --------
    Three topics of non-negative features; one batch fit, then the mAP of the pairs among
    themselves in each direction:

    >>> from streamxm.learning.evaluation import retrieval_maps, split_of
    >>> from streamxm.tools.datasets import synthetic_pairs
    >>> pairs = synthetic_pairs(90, 8, 5, n_classes=3, spread=0.3)
    >>> m = SAM(8, 5, dim=16, hidden=32, epochs=30, batch_size=20)
    >>> m.fit(pairs, np.random.default_rng(0), LearnStats())
    >>> maps = retrieval_maps(m, split_of(pairs))
    >>> bool(maps["map_i2t"] > 0.95 and maps["map_t2i"] > 0.95)
    True
    """

    #: Parameters added later, with their earlier behaviour: ``balance`` was off and the
    #: standardisation followed every pair. ``device`` needs no entry: a checkpoint without it
    #: restores with the default ``"auto"`` (the device is resolved again on the machine that
    #: restores; the arrays are the same).
    checkpoint_defaults: ClassVar[dict[str, Any]] = {"balance": False, "scale_pairs": None}

    def __init__(
        self,
        img_dim: int,
        txt_dim: int,
        dim: int = 200,
        hidden: int = 1024,
        dropout: float = 0.3,
        lr: float = 5e-3,
        momentum: float = 0.9,
        decay: float = 1e-6,
        batch_size: int = 200,
        lam: float = 0.25,
        f_a: float = 0.4,
        k: float = 0.1,
        n_e: float = 100.0,
        margin: float = 1.0,
        alpha: float | None = None,
        epochs: int = 100,
        epoch_pairs: int = 2000,
        step_every: int = 2,
        replay: int = 5000,
        centroid_rate: float = 0.1,
        max_classes: int = 1000,
        power_img: float | None = 0.5,
        power_txt: float | None = None,
        balance: bool = True,
        scale_pairs: int | None = 300,
        device: str = "auto",
    ) -> None:
        super().__init__(img_dim, txt_dim)
        self.device = device
        self.device_ = _resolve_device(device)
        require(
            locals(),
            dim=">= 1",
            hidden=">= 1",
            batch_size=">= 2",
            epochs=">= 0",
            epoch_pairs=">= 1",
            dropout="in [0, 1)",
            lr="> 0",
            momentum="in [0, 1)",
            decay=">= 0",
            lam="in [0, 1]",
            step_every=">= 1",
            centroid_rate="in (0, 1]",
        )
        if alpha is not None:
            require(locals(), alpha="in [0, 1]")
        if scale_pairs is not None:
            require(locals(), scale_pairs=">= 1")
        if step_every > batch_size:
            raise ValueError(f"step_every must be <= batch_size ({batch_size}), got {step_every}")
        if replay < batch_size:
            raise ValueError(f"replay must be >= batch_size ({batch_size}), got {replay}")
        self.dim, self.hidden, self.dropout = int(dim), int(hidden), float(dropout)
        self.lr, self.momentum, self.decay = float(lr), float(momentum), float(decay)
        self.batch_size = int(batch_size)
        self.lam, self.f_a, self.k, self.n_e = float(lam), float(f_a), float(k), float(n_e)
        self.margin = float(margin)
        self.alpha = None if alpha is None else float(alpha)
        self.epochs, self.epoch_pairs = int(epochs), int(epoch_pairs)
        self.step_every, self.replay = int(step_every), int(replay)
        self.centroid_rate = float(centroid_rate)
        self.max_classes = max_classes
        self.classes = ClassIndex(max_classes)
        self.power_img = None if power_img is None else float(power_img)
        self.power_txt = None if power_txt is None else float(power_txt)
        self.balance = bool(balance)
        self.scale_pairs = None if scale_pairs is None else int(scale_pairs)

        self.img_tower = Tower(img_dim, self.hidden, self.dim, self.device_)
        self.txt_tower = Tower(txt_dim, self.hidden, self.dim, self.device_)
        self.optimizer = torch.optim.SGD(
            self._parameters(), lr=self.lr, momentum=self.momentum, nesterov=self.momentum > 0
        )
        # The model's randomness (weights, dropout), on the CPU whatever the device, so its
        # checkpointed state is one format; on CUDA the masks come from a generator on the
        # device, re-seeded from this one each step (:meth:`_dropout_generator`).
        self.generator = torch.Generator()
        self._device_generator = (
            torch.Generator(device=self.device_) if self.device_.type != "cpu" else None
        )
        self.initialised = False
        self.img_scaler = FeatureScaler(img_dim)
        self.txt_scaler = FeatureScaler(txt_dim)
        self.scale_img = self.scale_txt = 0.0  # f_ms normalisers
        self.cent_img = torch.zeros(0, self.dim, device=self.device_)
        self.cent_txt = torch.zeros(0, self.dim, device=self.device_)
        self.cent_seen = torch.zeros(0, dtype=torch.bool, device=self.device_)
        self.reservoir = ReplayBuffer(self.replay, img_dim, txt_dim)
        self.reservoir_seen = 0
        self.pending: list[Pair] = []
        self.steps = 0
        self.clock = 0.0  # epochs (offline) or epoch-equivalents (stream) learned

    def params(self) -> dict[str, Any]:
        """The constructor's parameters, with ``device="cuda"`` recorded as ``"auto"``: a
        checkpoint resolves its device again where it is restored (see ``device``)."""
        params = super().params()
        if params["device"] == "cuda":
            params["device"] = "auto"
        return params

    def _parameters(self) -> list[nn.Parameter]:
        return [*self.img_tower.parameters(), *self.txt_tower.parameters()]

    def _tensor(self, x: NDArray[Any]) -> Tensor:
        """A numpy array as a tensor on the model's device (shared memory on the CPU)."""
        return torch.from_numpy(np.ascontiguousarray(x)).to(self.device_)

    def _numpy(self, x: Tensor) -> NDArray[Any]:
        """A new CPU numpy copy of a tensor on any device."""
        return x.detach().cpu().numpy().copy()

    def _dropout_generator(self) -> torch.Generator:
        """The generator of this step's dropout masks: the model's own on the CPU; on another
        device, the device's, seeded from the model's (one draw per tower a step)."""
        if self._device_generator is None:
            return self.generator
        seed = int(torch.randint(2**62, (1,), generator=self.generator))
        return self._device_generator.manual_seed(seed)

    def current_alpha(self) -> float:
        """``alpha(t)`` at the current clock (or the fixed ``alpha``)."""
        if self.alpha is not None:
            return self.alpha
        return schedule_alpha(self.clock, self.k, self.f_a, self.n_e)

    # -- learning ----------------------------------------------------------------------------
    def _start(self, rng: np.random.Generator) -> None:
        if self.initialised:
            return
        self.generator.manual_seed(int(rng.integers(2**62)))
        self.img_tower.reset(self.generator)
        self.txt_tower.reset(self.generator)
        self.initialised = True

    def _arrive(self, pairs: list[Pair], scale_all: bool = False) -> None:
        """Count the pairs' classes; their rows join the standardisation's statistics up to
        ``scale_pairs`` rows in all (every row with ``scale_all``: the offline training set)."""
        room = len(pairs)
        if not scale_all and self.scale_pairs is not None:
            room = max(0, min(room, self.scale_pairs - self.img_scaler.n))
        if room:
            scaled = pairs[:room]
            self.img_scaler.add(self._rows(np.stack([p.img for p in scaled]), self.power_img))
            self.txt_scaler.add(self._rows(np.stack([p.txt for p in scaled]), self.power_txt))
        for p in pairs:
            self.classes.columns(p.labels)

    def _keep(self, pair: Pair, rng: np.random.Generator) -> None:
        """Reservoir sampling (Algorithm R): every pair so far is in it with equal chance."""
        if self.reservoir.size < self.replay:
            self.reservoir.add(pair)
        else:
            j = int(rng.integers(self.reservoir_seen + 1))
            if j < self.replay:
                self.reservoir.put(j, pair)
        self.reservoir_seen += 1

    def update(
        self,
        pair: Pair,
        slot: int,
        buffer: ReplayBuffer,
        rng: np.random.Generator,
        stats: LearnStats,
    ) -> None:
        self._start(rng)
        self._arrive([pair])
        self.pending.append(pair)
        if len(self.pending) < self.step_every:
            return
        fresh, self.pending = self.pending, []
        fill = min(self.batch_size - len(fresh), self.reservoir.size)
        # A burst of few classes: every class equally likely in the fill (see the docstring).
        mix = (
            self.reservoir.balanced_mix(np.arange(self.reservoir.size))
            if self.balance and buffer.bursty()
            else None
        )
        slots = rng.choice(self.reservoir.size, size=fill, replace=False, p=mix)
        img = np.vstack([np.stack([p.img for p in fresh]), self.reservoir.img[slots]])
        txt = np.vstack([np.stack([p.txt for p in fresh]), self.reservoir.txt[slots]])
        labels = [p.labels for p in fresh] + self._stored_labels(slots)
        if len(img) >= 2:
            new = np.zeros(len(img), dtype=bool)
            new[: len(fresh)] = True
            self.step(img, txt, labels, new, stats, self.epoch_pairs)
        for p in fresh:
            self._keep(p, rng)

    def fit(self, pairs: list[Pair], rng: np.random.Generator, stats: LearnStats) -> None:
        """``epochs`` passes over ``pairs`` in mini-batches (the paper's training)."""
        for _ in self.fit_epochs(pairs, rng, stats):
            pass

    def fit_epochs(
        self, pairs: list[Pair], rng: np.random.Generator, stats: LearnStats
    ) -> Iterator[int]:
        """:meth:`fit`, yielding the number of epochs done after each one (to trace them)."""
        self._start(rng)
        self._arrive(pairs, scale_all=True)
        img = np.stack([p.img for p in pairs])
        txt = np.stack([p.txt for p in pairs])
        labels = [p.labels for p in pairs]
        sample = rng.choice(len(pairs), size=min(len(pairs), 4096), replace=False)
        self._observe_scale(*self._distances(img[sample], txt[sample]))
        for p in pairs:  # so that a stream can continue from the fitted model
            self._keep(p, rng)
        for epoch in range(self.epochs):
            order = rng.permutation(len(pairs))
            for at in range(0, len(order), self.batch_size):
                rows = order[at : at + self.batch_size]
                if len(rows) < 2:
                    continue
                self.step(
                    img[rows],
                    txt[rows],
                    [labels[i] for i in rows],
                    np.ones(len(rows), dtype=bool),
                    stats,
                    len(pairs),
                )
            yield epoch + 1

    @staticmethod
    def _rows(x: NDArray[np.floating], power: float | None) -> NDArray[np.floating]:
        """Inputs before standardisation: as sent, or power-mapped and L2-normalised."""
        return x if power is None else power_normalize(x, power)

    def _prepare(
        self, x: NDArray[np.floating], scaler: FeatureScaler, power: float | None
    ) -> Tensor:
        """A tower's input rows, float32 on the model's device: power-mapped and L2-normalised
        when ``power`` is set (:func:`~streamxm.models.moments.power_normalize`'s map), then
        standardised by ``scaler``'s running moments (computed in float64, applied in
        float32)."""
        rows = self._tensor(np.asarray(x, dtype=np.float32))  # shares the caller's memory
        if power is not None:
            mapped = rows.abs() if power == 1.0 else rows.abs().pow_(power)
            rows = mapped.mul_(rows.sign())
            norms = torch.linalg.vector_norm(rows, dim=1, keepdim=True)
            rows.div_(norms.masked_fill_(norms == 0, 1.0))
        mean, std = (self._tensor(v.astype(np.float32)) for v in scaler.standardisation())
        return (rows - mean).div_(std)

    def _stored_labels(self, slots: NDArray[np.int_]) -> list[tuple[int, ...]]:
        return label_tuples(self.reservoir.labels[slots])

    def _distances(
        self, img: NDArray[np.floating], txt: NDArray[np.floating]
    ) -> tuple[Tensor, Tensor]:
        """Euclidean distances between the rows, per modality, on the vectors as sent."""
        ti = self._tensor(np.asarray(img, dtype=np.float32))
        tt = self._tensor(np.asarray(txt, dtype=np.float32))
        return pairwise_distances(ti), pairwise_distances(tt)

    def _observe_scale(self, dist_img: Tensor, dist_txt: Tensor) -> None:
        """Raise the ``f_ms`` normalisers to the largest of these distances."""
        self.scale_img = max(self.scale_img, float(dist_img.max()))
        self.scale_txt = max(self.scale_txt, float(dist_txt.max()))

    def _category_matrix(self, labels: list[tuple[int, ...]]) -> Tensor:
        """(b, classes) 0/1: the known classes of each item (filled on the CPU, then moved)."""
        y = np.zeros((len(labels), len(self.classes)), dtype=np.float32)
        rows: list[int] = []
        cols: list[int] = []
        for i, item in enumerate(labels):
            found = self.classes.columns(item, arriving=False)
            rows += [i] * len(found)
            cols += found
        y[rows, cols] = 1.0  # one assignment: indexing a tensor per item is slow
        return torch.from_numpy(y).to(self.device_)

    def _update_centroids(self, y: Tensor, zi: Tensor, zt: Tensor) -> None:
        grow = y.shape[1] - self.cent_img.shape[0]
        if grow > 0:
            zeros = torch.zeros(grow, self.dim, device=self.device_)
            self.cent_img = torch.cat([self.cent_img, zeros])
            self.cent_txt = torch.cat([self.cent_txt, zeros])
            self.cent_seen = torch.cat(
                [self.cent_seen, torch.zeros(grow, dtype=torch.bool, device=self.device_)]
            )
        counts = y.sum(dim=0)
        present = counts > 0
        rate = torch.where(self.cent_seen, self.centroid_rate, 1.0)[present, None]
        for cent, z in ((self.cent_img, zi), (self.cent_txt, zt)):
            means = (y.T @ z)[present] / counts[present, None]
            cent[present] = (1.0 - rate) * cent[present] + rate * means
        self.cent_seen |= present

    def margins(self, dist_img: Tensor, dist_txt: Tensor, y: Tensor) -> Tensor:
        """``f_m`` for every (anchor, negative) pair of a mini-batch, from its input-space
        distances (:meth:`_distances`) and categories ``y``."""
        f_ms = semantic_margin(dist_img, dist_txt, self.scale_img, self.scale_txt)
        alpha = self.current_alpha()
        labelled = y.sum(dim=1) > 0
        if bool(labelled.any()) and self.lam < 1:
            per_item = y / y.sum(dim=1, keepdim=True).clamp(min=1.0)
            f_mc = centroid_margin(per_item @ self.cent_img, per_item @ self.cent_txt)
            both = labelled[:, None] & labelled[None, :]
            f_am = torch.where(both, self.lam * f_ms + (1 - self.lam) * f_mc, f_ms)
        else:
            f_am = f_ms
        return alpha * f_am + (1 - alpha) * self.margin

    def step(
        self,
        img: NDArray[np.floating],
        txt: NDArray[np.floating],
        labels: list[tuple[int, ...]],
        new: NDArray[np.bool_],
        stats: LearnStats,
        epoch: int,
    ) -> float:
        """One SGD step on a mini-batch; returns its loss. ``new`` marks the anchors whose
        triplets enter ``stats``; ``epoch`` is the clock's unit in rows. The gradients are the
        chain rule written out (:func:`score_gradient`, :meth:`Tower.set_gradients`); the step
        runs with subnormal numbers flushed to zero (:func:`_subnormals_flushed`)."""
        with _subnormals_flushed():
            return self._step(img, txt, labels, new, stats, epoch)

    def _step(
        self,
        img: NDArray[np.floating],
        txt: NDArray[np.floating],
        labels: list[tuple[int, ...]],
        new: NDArray[np.bool_],
        stats: LearnStats,
        epoch: int,
    ) -> float:
        b = len(img)
        y = self._category_matrix(labels)
        negatives = self._negatives(y)
        xi = self._prepare(img, self.img_scaler, self.power_img)
        xt = self._prepare(txt, self.txt_scaler, self.power_txt)
        with torch.no_grad():
            img_pass = self.img_tower.train_forward(xi, self._multipliers(b))
            txt_pass = self.txt_tower.train_forward(xt, self._multipliers(b))
            zi, zt = img_pass.z, txt_pass.z
            self._update_centroids(y, zi, zt)
            distances = self._distances(img, txt)
            self._observe_scale(*distances)
            margins = self.margins(*distances, y)
            s = zi @ zt.T
            i2t, t2i = batch_loss(s, margins, negatives)
            loss = float(i2t.sum() + t2i.sum()) / b
            self._record(
                s, i2t, t2i, negatives, self._tensor(np.asarray(new, dtype=np.bool_)), stats
            )
            grad_s = score_gradient(i2t, t2i)
            self.img_tower.set_gradients(img_pass, grad_s @ zt)
            self.txt_tower.set_gradients(txt_pass, grad_s.T @ zi)
        self._descend(self.lr / (1.0 + self.decay * self.steps))
        self.steps += 1
        self.clock += b / epoch
        return loss

    def _descend(self, lr: float) -> None:
        """The optimiser's step at learning rate ``lr``: on the CPU with momentum, one compiled
        pass per parameter (:func:`~streamxm.models.optim.nesterov_step`, torch's rule) over
        the momentum buffers the torch optimiser holds (so its state is the checkpoint's);
        elsewhere the torch optimiser itself."""
        if self.device_.type != "cpu" or self.momentum == 0:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            return
        for p in self._parameters():
            state = self.optimizer.state[p]
            if "momentum_buffer" not in state:  # torch's first step: the buffer is the gradient
                state["momentum_buffer"] = torch.zeros_like(
                    p, memory_format=torch.contiguous_format
                )
            assert p.grad is not None
            nesterov_step(
                p.detach().numpy(),
                state["momentum_buffer"].numpy(),
                p.grad.numpy(),
                lr,
                self.momentum,
            )

    def _negatives(self, y: Tensor) -> Tensor:
        """(b, b): whether item ``n`` is a negative of anchor ``a`` (see the class docstring)."""
        labelled = y.sum(dim=1) > 0
        unshared = (y @ y.T) == 0
        # a labelled anchor: the labelled items sharing no label; an unlabelled one: all
        negatives = unshared.logical_and_(labelled[None, :]).logical_or_(~labelled[:, None])
        return negatives.fill_diagonal_(False)

    def _multipliers(self, rows: int) -> Tensor | None:
        """This step's dropout multipliers for one tower's ``rows x hidden`` activations."""
        if self.dropout == 0:
            return None
        return dropout_multipliers(
            (rows, self.hidden), self.dropout, self._dropout_generator(), self.device_
        )

    @staticmethod
    def _record(
        s: Tensor, i2t: Tensor, t2i: Tensor, negatives: Tensor, new: Tensor, stats: LearnStats
    ) -> None:
        """The triplets of the new anchors: their rows of the scores, hinges and negatives."""
        pos = torch.diagonal(s)[new, None]
        rows = negatives[new]
        for direction, scores, hinge in (("i2t", s[new], i2t[new]), ("t2i", s.T[new], t2i[new])):
            stats.triplets[direction] += int(rows.sum())
            stats.mistakes[direction] += int(((pos - scores <= 0) & rows).sum())
            stats.loss[direction] += float(hinge[rows].sum())
            stats.updates[direction] += int(((hinge > 0) & rows).sum())

    # -- serving -------------------------------------------------------------------------------
    def _embed(
        self, tower: Tower, scaler: FeatureScaler, power: float | None, x: NDArray[np.floating]
    ) -> NDArray[np.float32]:
        x = np.atleast_2d(x)
        if not self.initialised:
            return np.zeros((len(x), self.dim), dtype=np.float32)
        out = np.empty((len(x), self.dim), dtype=np.float32)
        with torch.no_grad():
            for at in range(0, len(x), _EMBED_ROWS):
                chunk = self._prepare(x[at : at + _EMBED_ROWS], scaler, power)
                out[at : at + _EMBED_ROWS] = tower(chunk).cpu().numpy()
        return out

    def embed_images(self, x: NDArray[np.floating]) -> NDArray[np.float32]:
        return self._embed(self.img_tower, self.img_scaler, self.power_img, x)

    def embed_texts(self, x: NDArray[np.floating]) -> NDArray[np.float32]:
        return self._embed(self.txt_tower, self.txt_scaler, self.power_txt, x)

    # -- the work counted (streamxm/models/work.py) ----------------------------------------------
    def periodic_work(self) -> tuple[int, int]:
        """A step every ``step_every`` pairs."""
        return 0, self.step_every

    def learning_work(self) -> Work:
        """Per pair, ``1 / step_every`` of one step on a mini-batch of ``b = batch_size`` rows
        (``b / step_every`` rows of gradient work per pair; the reservoir holds ``replay >= b``
        pairs in the steady state, so every step has ``b`` rows), float32 throughout
        (:meth:`_step_work`). Per arriving pair, the scaler's sums (the first ``scale_pairs``)
        and the reservoir's write are ``O(d_v + d_t)`` and not counted."""
        return self._step_work() * (1.0 / self.step_every)

    def _step_work(self) -> Work:
        """One :meth:`step` on ``b`` rows, with ``C`` the classes seen so far (at least one:
        the category matrix grows with them) and ``P`` parameters:

        - gathering: ``b`` rows of each modality from the reservoir and stacked (16 B per item);
        - both towers: inputs prepared (:func:`_prepare_work`) and one forward and backward pass
          of ``b`` rows (:func:`~streamxm.models.sam_tower.tower_training_work`): ``2 b (d_in h +
          h d) + 2 b d_in h + 4 b h d`` flops per tower;
        - scores ``S = Z_v Z_t^T`` and its two backward products: ``3 x 2 b^2 d``; centroid
          cosines ``U U^T`` per modality: ``2 x 2 b^2 d``; input distances
          (:func:`_distance_work`): ``2 b^2 (d_v + d_t)``; ``b x b`` elementwise passes;
        - categories: ``Y Y^T`` (``2 b^2 C``), the class sums ``Y^T Z`` per modality (``2 x 2 C b
          d``), the items' centroids ``Y_n Cent`` per modality (``2 x 2 b C d``), passes over
          ``Y`` (``b x C``);
        - Nesterov SGD, ``buf = mu buf + g``, ``w -= lr (g + mu buf)``: on the CPU one pass
          (:func:`~streamxm.models.optim.nesterov_work`: 5 flops and 20 B per parameter),
          elsewhere torch's single-tensor path (7 flops and 11 float32 passes, 44 B).
        """
        b, h, d, c = self.batch_size, self.hidden, self.dim, max(1, len(self.classes))
        total = Work(0.0, 16.0 * b * (self.img_dim + self.txt_dim))
        params = 0
        for in_dim, power in ((self.img_dim, self.power_img), (self.txt_dim, self.power_txt)):
            total += (
                _prepare_work(b, in_dim, power)
                + tower_training_work(b, in_dim, h, d)
                + _distance_work(b, in_dim)
                + gemm(b, b, d, _NET)  # centroid cosines U U^T
                + gemm(c, d, b, _NET)  # class sums Y^T Z
                + gemm(b, d, c, _NET)
            )  # items' centroids Y_n Cent
            params += (in_dim + 1) * h + (h + 1) * d
        total += gemm(b, b, d, _NET) * 3.0  # S and its two backward products
        total += elementwise(b * b, _NET, _PAIRWISE_FLOPS, _PAIRWISE_PASSES)
        total += gemm(b, b, c, _NET)  # shared classes Y Y^T
        total += elementwise(b * c, _NET, flops_per_item=3.0, passes=_CATEGORY_PASSES)
        if self.device_.type == "cpu" and self.momentum > 0:
            return total + nesterov_work(params)
        return total + elementwise(params, _NET, flops_per_item=7.0, passes=11.0)

    def embedding_work(self, rows: int, modality: str) -> Work:
        """Per chunk of ``r <= 4096`` rows (:data:`_EMBED_ROWS`; the weights are read once per
        chunk): the inputs prepared (:func:`_prepare_work`) and the tower's inference pass
        (:func:`~streamxm.models.sam_tower.tower_forward_work`): ``2 r (d_in h + h d)`` flops."""
        if modality == "image":
            in_dim, power = self.img_dim, self.power_img
        elif modality == "text":
            in_dim, power = self.txt_dim, self.power_txt
        else:
            raise ValueError(f"modality must be 'image' or 'text', got {modality!r}")
        total = Work()
        full, rest = divmod(rows, _EMBED_ROWS)
        for chunk, times in ((_EMBED_ROWS, full), (rest, 1 if rest else 0)):
            if times:
                total += times * (
                    _prepare_work(chunk, in_dim, power)
                    + tower_forward_work(chunk, in_dim, self.hidden, self.dim)
                )
        return total

    # -- several ranks ---------------------------------------------------------------------------
    merge_every = 64

    def register_labels(self, labels: list[tuple[int, ...]]) -> None:
        for item in labels:
            self.classes.columns(item, arriving=False)

    def merge_parts(self) -> MergeParts | None:
        if not self.steps:
            return None
        parts: MergeParts = {}
        for name, p in self._named_parameters():
            # Views of the live tensors on the CPU (copies from another device): the merge
            # reads them, and set_merged writes the result back.
            parts[f"w.{name}"] = ("mean", p.detach().cpu().numpy())
            parts[f"momentum.{name}"] = (
                "mean",
                self.optimizer.state[p]["momentum_buffer"].cpu().numpy(),
            )
        for key, scaler in (("img", self.img_scaler), ("txt", self.txt_scaler)):
            parts.update(
                {k: ("sum", np.asarray(v)) for k, v in scaler.state(f"scaler_{key}.").items()}
            )
        parts["scales"] = ("max", np.array([self.scale_img, self.scale_txt]))
        grow = max(len(self.classes) - self.cent_img.shape[0], 0)
        seen = torch.cat([self.cent_seen.cpu(), torch.zeros(grow, dtype=torch.bool)])
        weight = seen.numpy().astype(np.float32)
        for key, cent in (("cent_img", self.cent_img), ("cent_txt", self.cent_txt)):
            full = torch.cat([cent.cpu(), torch.zeros(grow, self.dim)]).numpy()
            parts[key] = ("total", full * weight[:, None])
        parts["cent_seen"] = ("total", weight)
        parts["steps"] = ("sum", np.asarray(self.steps))
        parts["clock"] = ("sum", np.asarray(self.clock))
        parts["ignored_labels"] = ("sum", np.asarray(self.classes.ignored_labels))
        return parts

    def set_merged(self, merged: Arrays) -> None:
        with torch.no_grad():
            for name, p in self._named_parameters():
                p.copy_(torch.from_numpy(np.asarray(merged[f"w.{name}"], dtype=np.float32)))
                self.optimizer.state[p]["momentum_buffer"].copy_(
                    torch.from_numpy(np.asarray(merged[f"momentum.{name}"], dtype=np.float32))
                )
        self.img_scaler.load_state(merged, "scaler_img.")
        self.txt_scaler.load_state(merged, "scaler_txt.")
        self.scale_img, self.scale_txt = (float(x) for x in merged["scales"])
        holders = np.asarray(merged["cent_seen"], dtype=np.float32)
        for key in ("cent_img", "cent_txt"):
            mean = np.asarray(merged[key], dtype=np.float32) / np.maximum(holders, 1.0)[:, None]
            setattr(self, key, self._tensor(mean))
        self.cent_seen = self._tensor(holders > 0)
        self.steps, self.clock = int(merged["steps"]), float(merged["clock"])
        self.classes.ignored_labels = int(merged["ignored_labels"])

    # -- state ---------------------------------------------------------------------------------
    def _named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(f"img.{n}", p) for n, p in self.img_tower.named_parameters()] + [
            (f"txt.{n}", p) for n, p in self.txt_tower.named_parameters()
        ]

    def state(self) -> tuple[Arrays, dict[str, Any]]:
        arrays: Arrays = {}
        for name, p in self._named_parameters():
            arrays[f"w.{name}"] = self._numpy(p)
            buf = self.optimizer.state.get(p, {}).get("momentum_buffer")
            if buf is not None:
                arrays[f"momentum.{name}"] = self._numpy(buf)
        arrays.update(self.img_scaler.state("scaler_img."))
        arrays.update(self.txt_scaler.state("scaler_txt."))
        arrays["cent_img"] = self._numpy(self.cent_img)
        arrays["cent_txt"] = self._numpy(self.cent_txt)
        arrays["cent_seen"] = self._numpy(self.cent_seen)
        arrays["torch_rng"] = self.generator.get_state().numpy().copy()
        reservoir_arrays, reservoir_meta = self.reservoir.state()
        arrays.update({f"reservoir.{k}": v for k, v in reservoir_arrays.items()})
        pending = ReplayBuffer(max(len(self.pending), 1), self.img_dim, self.txt_dim)
        for pair in self.pending:
            pending.add(pair)
        pending_arrays, _ = pending.state()
        arrays.update({f"pending.{k}": v for k, v in pending_arrays.items()})
        meta = {
            "initialised": self.initialised,
            "steps": self.steps,
            "clock": self.clock,
            "scale_img": self.scale_img,
            "scale_txt": self.scale_txt,
            "classes": self.classes.classes,
            "ignored_labels": self.classes.ignored_labels,
            "reservoir": reservoir_meta,
            "reservoir_seen": self.reservoir_seen,
            "pending": len(self.pending),
        }
        return arrays, meta

    def load_state(self, arrays: Arrays, meta: dict[str, Any]) -> None:
        with torch.no_grad():
            for name, p in self._named_parameters():
                p.copy_(torch.from_numpy(np.asarray(arrays[f"w.{name}"], dtype=np.float32)))
                if f"momentum.{name}" in arrays:
                    self.optimizer.state[p]["momentum_buffer"] = self._tensor(
                        np.array(arrays[f"momentum.{name}"], dtype=np.float32)
                    )
        self.img_scaler.load_state(arrays, "scaler_img.")
        self.txt_scaler.load_state(arrays, "scaler_txt.")
        self.cent_img = self._tensor(np.array(arrays["cent_img"], dtype=np.float32))
        self.cent_txt = self._tensor(np.array(arrays["cent_txt"], dtype=np.float32))
        self.cent_seen = self._tensor(np.array(arrays["cent_seen"], dtype=np.bool_))
        self.generator.set_state(torch.from_numpy(np.array(arrays["torch_rng"], dtype=np.uint8)))
        self.reservoir = ReplayBuffer.from_state(
            {k[10:]: v for k, v in arrays.items() if k.startswith("reservoir.")}, meta["reservoir"]
        )
        self.reservoir_seen = int(meta["reservoir_seen"])
        self.pending = [
            make_pair(
                f"pending-{i}",
                arrays["pending.img"][i],
                arrays["pending.txt"][i],
                labels=[int(x) for x in arrays["pending.labels"][i] if x >= 0],
            )
            for i in range(int(meta["pending"]))
        ]
        self.initialised = bool(meta["initialised"])
        self.steps, self.clock = int(meta["steps"]), float(meta["clock"])
        self.scale_img, self.scale_txt = float(meta["scale_img"]), float(meta["scale_txt"])
        self.classes.restore(meta["classes"], meta["ignored_labels"])
        # The learning rate is a function of the step count, set before every step.
