"""SAM: two towers trained on bi-directional triplets with a scheduled adaptive margin.

Semedo and Magalhaes, "Cross-Modal Subspace Learning with Scheduled Adaptive Margin
Constraints", ACM MM 2019. The margin arithmetic (Eq. 6-10) is in the module-level functions,
so it can be checked by hand; :class:`SAM` is the model. Its machinery is in the modules beside
it: the towers (:mod:`~streamxm.models.sam_tower`), their inputs
(:mod:`~streamxm.models.sam_inputs`), what each step learns from
(:mod:`~streamxm.models.sam_replay`), the step itself (:mod:`~streamxm.models.sam_step`), the
state and the merge of several ranks (:mod:`~streamxm.models.sam_state`) and the work counted
(:mod:`~streamxm.models.sam_work`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor, nn

from streamxm.buffer.replay import ReplayBuffer
from streamxm.models import sam_state, sam_work
from streamxm.models.array_types import Vectors
from streamxm.models.base import Arrays, LearnStats, MergeParts, require
from streamxm.models.classes import ClassIndex
from streamxm.models.history import Example, History
from streamxm.models.moments import FeatureScaler
from streamxm.models.opt_in import CountsWork, MergesRanks
from streamxm.models.sam_average import match_live, new_averages, served_towers
from streamxm.models.sam_inputs import (
    embed_rows,
    input_distances,
    pairwise_distances,
)
from streamxm.models.sam_replay import Labels, fit_epochs, learn_arrival
from streamxm.models.sam_step import (
    batch_loss,
    category_matrix,
    score_gradient,
    train_step,
    update_centroids,
)
from streamxm.models.sam_tower import Tower
from streamxm.models.work import Work

__all__ = [
    "SAM",
    "Tower",
    "batch_loss",
    "centroid_margin",
    "pairwise_distances",
    "schedule_alpha",
    "scheduled_margin",
    "score_gradient",
    "semantic_margin",
]


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


def scheduled_margin(
    f_ms: Tensor,
    y: Tensor,
    centroids: tuple[Tensor, Tensor],
    lam: float,
    alpha: float,
    margin: float,
) -> Tensor:
    """``f_m = alpha f_am + (1 - alpha) m`` for every (anchor, negative) pair of a mini-batch,
    with ``f_am = lam f_ms + (1 - lam) f_mc`` where both items are labelled and ``f_ms`` alone
    otherwise (a triplet with an unlabelled side has no category). ``f_mc``
    (:func:`centroid_margin`) compares the items' centroids: per item of the categories ``y``,
    the mean of its classes' image and text ``centroids``.

    >>> f_ms = torch.full((3, 3), 0.5)
    >>> y = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])  # the third item unlabelled
    >>> cents = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([[1.0, 0.0], [-1.0, 0.0]])
    >>> scheduled_margin(f_ms, y, cents, lam=0.25, alpha=1.0, margin=1.0)[0]
    tensor([0.1250, 0.6875, 0.5000])
    """
    labelled = y.sum(dim=1) > 0
    if bool(labelled.any()) and lam < 1:
        per_item = y / y.sum(dim=1, keepdim=True).clamp(min=1.0)
        f_mc = centroid_margin(per_item @ centroids[0], per_item @ centroids[1])
        both = labelled[:, None] & labelled[None, :]
        f_am = torch.where(both, lam * f_ms + (1 - lam) * f_mc, f_ms)
    else:
        f_am = f_ms
    return alpha * f_am + (1 - alpha) * margin


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


def _check_parameters(values: dict[str, Any]) -> None:
    """The rules of :class:`SAM`'s parameters, given by name (the constructor's ``locals()``):
    the first that one breaks raises a ``ValueError`` naming it."""
    require(
        values,
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
        ema="in [0, 1)",
        rehearse=">= 0",
    )
    if values["alpha"] is not None:
        require(values, alpha="in [0, 1]")
    if values["stream_n_e"] is not None:
        require(values, stream_n_e="> 0")
    if values["scale_pairs"] is not None:
        require(values, scale_pairs=">= 1")
    batch_size, step_every, replay = values["batch_size"], values["step_every"], values["replay"]
    if step_every > batch_size:
        raise ValueError(f"step_every must be <= batch_size ({batch_size}), got {step_every}")
    if replay < batch_size:
        raise ValueError(f"replay must be >= batch_size ({batch_size}), got {replay}")


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
        Eq. 7's ``n_e`` in epochs, offline (the paper's: its number of epochs).
    stream_n_e : float or None, default=50.0
        Eq. 7's ``n_e`` on a stream, in epoch-equivalents, ``> 0`` (a stream has no number of
        epochs); ``None``: ``n_e``, the rule before.
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
    burst_scale : bool, default=True
        During a burst of few classes arriving pairs join the standardisation past
        ``scale_pairs`` (a bursty stream's first pairs hold few classes); ``False``: not.
    device : {"auto", "cpu", "cuda"}, default="auto"
        Where the towers, the optimiser state, the centroids and every tensor of a step live:
        ``"auto"`` (CUDA when ``torch.cuda.is_available()``, else the CPU), ``"cpu"`` or
        ``"cuda"`` (a ``ValueError`` on a machine without CUDA). The numpy interfaces
        (embeddings, similarity, :meth:`state`, :meth:`load_state`) take and return CPU arrays
        whatever it is; :meth:`params` records ``"cuda"`` as ``"auto"``, so a checkpoint
        resolves its device again on the machine that restores it.
    ema : float, default=0.0
        Decay per step of a moving average of the towers' weights, in ``[0, 1)``: above 0 the
        embeddings read the average while the optimiser steps the live weights
        (:mod:`~streamxm.models.sam_average`); 0 serves the live weights, the paper's rule.
    rehearse : int, default=1
        During a burst, steps after each stream step on class-balanced batches of the reservoir
        alone, ``>= 0`` (not in :meth:`learning_work`); 0, the paper's one step per batch.

    Attributes
    ----------
    device_ : torch.device
        The resolved device.
    img_tower, txt_tower : Tower
        The two towers.
    average : tuple of Tower or None
        The towers' moving averages, image then text, which serve (``None`` at ``ema = 0``).
    img_scaler, txt_scaler : FeatureScaler
        The inputs' standardisation statistics.
    cent_img, cent_txt : Tensor of shape (n_classes, dim)
        Per class, the exponentially weighted mean projection of each modality.
    reservoir : ReplayBuffer
        The uniform reservoir sample of the stream that fills the mini-batches.
    pending : list of Example
        Arrived pairs waiting for the next step.
    steps : int
        SGD steps taken.
    clock : float
        ``t`` of Eq. 7: epochs (offline) or epoch-equivalents (stream) learned.

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

    #: Parameters added later, with their earlier behaviour (``balance`` off, every pair
    #: standardised, live towers served, no rehearsal); ``device`` restores as ``"auto"``.
    checkpoint_defaults: ClassVar[dict[str, Any]] = {
        "balance": False,
        "scale_pairs": None,
        "ema": 0.0,
        "rehearse": 0,
        "burst_scale": False,
        "stream_n_e": None,
    }

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
        stream_n_e: float | None = 50.0,
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
        burst_scale: bool = True,
        device: str = "auto",
        ema: float = 0.0,
        rehearse: int = 1,
    ) -> None:
        super().__init__(img_dim, txt_dim)
        self.device = device
        self.device_ = _resolve_device(device)
        _check_parameters(locals())
        self.dim, self.hidden, self.dropout = int(dim), int(hidden), float(dropout)
        self.lr, self.momentum, self.decay = float(lr), float(momentum), float(decay)
        self.batch_size = int(batch_size)
        self.lam, self.f_a, self.k, self.n_e = float(lam), float(f_a), float(k), float(n_e)
        self.stream_n_e = None if stream_n_e is None else float(stream_n_e)
        self.on_stream = True  # which n_e the schedule reads: set by learn_one and fit
        self.margin, self.alpha = float(margin), None if alpha is None else float(alpha)
        self.epochs, self.epoch_pairs = int(epochs), int(epoch_pairs)
        self.step_every, self.replay = int(step_every), int(replay)
        self.centroid_rate, self.burst_scale = float(centroid_rate), bool(burst_scale)
        self.max_classes = max_classes
        self.classes = ClassIndex(max_classes)
        self.power_img = None if power_img is None else float(power_img)
        self.power_txt = None if power_txt is None else float(power_txt)
        self.balance, self.rehearse = bool(balance), int(rehearse)
        self.scale_pairs = None if scale_pairs is None else int(scale_pairs)

        self.img_tower = Tower(img_dim, self.hidden, self.dim, self.device_)
        self.txt_tower = Tower(txt_dim, self.hidden, self.dim, self.device_)
        self.ema = float(ema)
        self.average = new_averages(self)
        self.optimizer = torch.optim.SGD(
            self._parameters(), lr=self.lr, momentum=self.momentum, nesterov=self.momentum > 0
        )
        # The model's randomness (weights, dropout), on the CPU whatever the device, so its
        # checkpointed state is one format; on CUDA the masks come from a generator on the
        # device, re-seeded from this one each step (:func:`.sam_tower.step_multipliers`).
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
        self.pending: list[Example] = []
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

    def _named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(f"img.{n}", p) for n, p in self.img_tower.named_parameters()] + [
            (f"txt.{n}", p) for n, p in self.txt_tower.named_parameters()
        ]

    def current_alpha(self) -> float:
        """``alpha(t)`` at the current clock (or the fixed ``alpha``)."""
        if self.alpha is not None:
            return self.alpha
        n_e = self.n_e if self.stream_n_e is None or not self.on_stream else self.stream_n_e
        return schedule_alpha(self.clock, self.k, self.f_a, n_e)

    # -- learning ----------------------------------------------------------------------------
    def _start(self, rng: np.random.Generator) -> None:
        if self.initialised:
            return
        self.generator.manual_seed(int(rng.integers(2**62)))
        self.img_tower.reset(self.generator)
        self.txt_tower.reset(self.generator)
        match_live(self)  # the average starts at the initial weights
        self.initialised = True

    def learn_one(
        self, pair: Example, history: History, rng: np.random.Generator, stats: LearnStats
    ) -> None:
        """A step every ``step_every`` pairs (:func:`.sam_replay.learn_arrival`)."""
        learn_arrival(self, pair, history, rng, stats)

    def fit(self, pairs: list[Example], rng: np.random.Generator, stats: LearnStats) -> None:
        """``epochs`` passes over ``pairs`` in mini-batches (the paper's training)."""
        for _ in self.fit_epochs(pairs, rng, stats):
            pass

    def fit_epochs(
        self, pairs: list[Example], rng: np.random.Generator, stats: LearnStats
    ) -> Iterator[int]:
        """:meth:`fit`, yielding the epochs done after each (:func:`.sam_replay.fit_epochs`)."""
        return fit_epochs(self, pairs, rng, stats)

    def _distances(self, img: Vectors, txt: Vectors) -> tuple[Tensor, Tensor]:
        """Euclidean distances between the rows, per modality, on the vectors as sent."""
        return input_distances(img, txt, self.device_)

    def _category_matrix(self, labels: Labels) -> Tensor:
        """(b, classes) 0/1: the known classes of each item."""
        return category_matrix(labels, self.classes, self.device_)

    def _update_centroids(self, y: Tensor, zi: Tensor, zt: Tensor) -> None:
        """The centroids moved towards the batch's class means (:func:`.update_centroids`)."""
        self.cent_img, self.cent_txt, self.cent_seen = update_centroids(
            (self.cent_img, self.cent_txt), self.cent_seen, y, (zi, zt), self.centroid_rate
        )

    def margins(self, dist_img: Tensor, dist_txt: Tensor, y: Tensor) -> Tensor:
        """``f_m`` for every (anchor, negative) pair of a mini-batch, from its input-space
        distances (:meth:`_distances`) and categories ``y`` (:func:`scheduled_margin`)."""
        f_ms = semantic_margin(dist_img, dist_txt, self.scale_img, self.scale_txt)
        centroids = (self.cent_img, self.cent_txt)
        return scheduled_margin(f_ms, y, centroids, self.lam, self.current_alpha(), self.margin)

    def step(
        self,
        img: Vectors,
        txt: Vectors,
        labels: Labels,
        new: NDArray[np.bool_],
        stats: LearnStats,
        epoch: int,
    ) -> float:
        """One SGD step on a mini-batch (:func:`.sam_step.train_step`: gradients written out,
        subnormals flushed); returns its loss. ``new``: the anchors whose triplets enter
        ``stats``; ``epoch``: the clock's unit in rows."""
        return train_step(self, (img, txt, labels, new), stats, epoch)

    # -- serving -------------------------------------------------------------------------------
    def _embed(
        self, tower: Tower, scaler: FeatureScaler, power: float | None, x: NDArray[np.floating]
    ) -> NDArray[np.float32]:
        x = np.atleast_2d(x)
        if not self.initialised:
            return np.zeros((len(x), self.dim), dtype=np.float32)
        return embed_rows(x, tower, scaler, power, self.device_)

    def embed_images(self, x: NDArray[np.floating]) -> NDArray[np.float32]:
        return self._embed(served_towers(self)[0], self.img_scaler, self.power_img, x)

    def embed_texts(self, x: NDArray[np.floating]) -> NDArray[np.float32]:
        return self._embed(served_towers(self)[1], self.txt_scaler, self.power_txt, x)

    # -- the work counted (streamxm/models/work.py) ----------------------------------------------
    def periodic_work(self) -> tuple[int, int]:
        """A step every ``step_every`` pairs."""
        return 0, self.step_every

    def learning_work(self) -> Work:
        """Per pair, ``1 / step_every`` of one step (:func:`.sam_work.step_work`); per arriving
        pair, the scaler's sums (the first ``scale_pairs``) and the reservoir's write are
        ``O(d_v + d_t)`` and not counted."""
        return sam_work.step_work(self) * (1.0 / self.step_every)

    def embedding_work(self, rows: int, modality: str) -> Work:
        """The modality's tower over ``rows`` rows (:func:`.sam_work.embedding_work`)."""
        return sam_work.embedding_work(self, rows, modality)

    # -- several ranks ---------------------------------------------------------------------------
    merge_every = 64

    def register_labels(self, labels: Labels) -> None:
        for item in labels:
            self.classes.columns(item, arriving=False)

    def merge_parts(self) -> MergeParts | None:
        return sam_state.merge_parts(self)

    def set_merged(self, merged: Arrays) -> None:
        sam_state.set_merged(self, merged)

    # -- state ---------------------------------------------------------------------------------
    def state(self) -> tuple[Arrays, dict[str, Any]]:
        return sam_state.model_state(self)

    def load_state(self, arrays: Arrays, meta: dict[str, Any]) -> None:
        sam_state.load_state(self, arrays, meta)
