"""Linear heads: how a model embeds the gallery from features that do not change between its
versions.

A model whose embedding is ``finish(features(x) W + b)`` (cca, scsm, sdsrl, pairwise:marginal)
says so with :meth:`~streamxm.models.base.CrossModalModel.linear_head`. ``features`` depends on
the inputs and a few settings only (a power map, frozen landmarks), so a server computes it once
per gallery item and keeps it; each new version then costs one product of the kept features with
``W`` (``k`` columns: components, classes), not a pass of the whole model over the raw vectors.

Features are computed from the gallery's *unit rows* (each vector divided by its L2 norm): every
map here starts with :func:`~streamxm.models.moments.power_normalize`, which gives the same
result for a vector and any positive multiple of it.

A server keeps features as :meth:`FeatureMap.keep` says: as computed (float32), or, for kernel
rows (as wide as the landmarks, wider than the gallery's own rows), as float16 complements whose
rounding :meth:`FeatureMap.kept_error` bounds, so that a search can prove its candidates
complete and score them from the raw vectors.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import numpy as np
from numpy.typing import NDArray

from streamxm.models.array_types import F32, F64
from streamxm.models.history import History
from streamxm.models.moments import power_normalize
from streamxm.models.work import Work, elementwise, gemm

__all__ = [
    "FeatureMap",
    "LinearHead",
    "PowerFeatures",
    "RbfFeatures",
    "SlotFeatures",
    "power_features",
    "rbf_kernel",
    "unit_features",
]


#: Rows per product in :meth:`LinearHead.embed` (bounds its float64 temporaries).
_ROWS = 8192
#: float16's unit roundoff (10 stored fraction bits) and the largest error of rounding a
#: value below its smallest normal number (2^-14), where the spacing is 2^-24.
_HALF_U = 2.0**-11
_HALF_SUBNORMAL = 2.0**-25


def rbf_kernel(
    x: NDArray[np.floating], y: NDArray[np.floating], gamma: float, y_norms: F64 | None = None
) -> F64:
    """``exp(-gamma ||x - y||^2)`` for every row pair (the paper's ``sigma`` is ``gamma``);
    ``y_norms``: the rows of ``y``'s squared norms (:func:`squared_norms`), kept by a caller
    whose ``y`` is fixed (landmarks) so that a call for a few rows reads ``y`` once, not twice.

    >>> rbf_kernel(np.array([[0.0, 0.0]]), np.array([[1.0, 0.0], [0.0, 0.0]]), gamma=1.0)
    array([[0.36787944, 1.        ]])
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    y_norms = squared_norms(y) if y_norms is None else y_norms
    sq = squared_norms(x)[:, None] + y_norms[None, :] - 2 * x @ y.T
    return np.asarray(np.exp(-gamma * np.maximum(sq, 0.0)))


def squared_norms(x: NDArray[np.floating]) -> F64:
    """Each row's squared L2 norm."""
    return np.asarray(np.einsum("ij,ij->i", x, x))


class FeatureMap:
    """Version-independent features of unit rows. ``key`` names the map (equal keys: equal
    features, so servers share them between models); ``inputs`` is the map whose features this
    one reads (``None``: the unit rows themselves)."""

    key: tuple[object, ...]
    inputs: FeatureMap | None
    #: Galleries of at least this many rows keep these features as :meth:`keep` keeps them
    #: (``None``: always as computed); smaller ones keep float32 rows, whose embeddings are
    #: the version's own scores, so a search needs no pass over its candidates' raw vectors.
    compact_from_rows: ClassVar[int | None] = None

    def compact(self, gallery_rows: int) -> bool:
        """Whether a gallery of ``gallery_rows`` keeps these features compact (:meth:`keep`)."""
        return self.compact_from_rows is not None and gallery_rows >= self.compact_from_rows

    def apply(self, x: F32) -> F32:
        """This map's features of ``inputs``' features ``x`` (float32)."""
        raise NotImplementedError

    def extend(self, kept: Mapping[tuple[object, ...], F32], x: F32) -> F32 | None:
        """This map's features of ``x`` from the features of another map kept for the same
        rows (``kept``: key -> features), when some can be extended; ``None`` otherwise."""
        return None

    def keep(self, features: F32) -> NDArray[np.floating]:
        """``features`` as a server keeps them (:meth:`restore` gives them back): the float32
        features themselves."""
        return features

    def restore(
        self, kept: NDArray[np.floating], dtype: type[np.floating] = np.float32
    ) -> NDArray[np.floating]:
        """The features of rows kept by :meth:`keep`, as ``dtype`` (float32 rows pass)."""
        return np.asarray(kept, dtype=dtype)

    def kept_error(self, kept: NDArray[np.floating]) -> float:
        """A bound on the L2 norm of any row's difference between the features and
        :meth:`restore` of ``kept``: 0 for features kept as computed."""
        return 0.0

    def work(self, rows: int, width: int) -> Work:
        """The work of :meth:`__call__` on ``rows`` unit rows of ``width`` values."""
        below = self.inputs.work(rows, width) if self.inputs is not None else Work()
        return below + self.own_work(rows, width)

    def own_work(self, rows: int, width: int) -> Work:
        """The work of :meth:`apply` alone."""
        raise NotImplementedError

    def __call__(self, units: F32) -> F32:
        """The features of unit rows, through every map below this one."""
        x = units if self.inputs is None else self.inputs(units)
        return self.apply(x)


@dataclass(frozen=True)
class PowerFeatures(FeatureMap):
    """``power_normalize(x, power)``: ``sign(x) |x|^power``, L2-normalised."""

    power: float
    inputs: FeatureMap | None = None

    @property
    def key(self) -> tuple[object, ...]:  # type: ignore[override]
        return ("power", self.power)

    def own_work(self, rows: int, width: int) -> Work:
        return elementwise(rows * width, itemsize=4, flops_per_item=6.0)

    def apply(self, x: F32) -> F32:
        out = np.empty_like(x, dtype=np.float32)
        for at in range(0, len(x), _ROWS):
            out[at : at + _ROWS] = power_normalize(x[at : at + _ROWS], self.power)
        return out


def power_features(power: float) -> PowerFeatures | None:
    """The features ``power_normalize(x, power)`` of unit rows: ``None`` (the unit rows
    themselves) for ``power = 1``."""
    return None if power == 1.0 else PowerFeatures(power)


@dataclass(frozen=True, eq=False)
class RbfFeatures(FeatureMap):
    """``exp(-gamma ||x - l||^2)`` against each landmark ``l`` (rows of ``landmarks``), of the
    ``inputs``' features: sdsrl's kernel rows, which stay the same once its landmarks freeze.

    Kept as float16 complements ``1 - k`` (:meth:`keep`): half the float32 bytes, for rows as
    wide as the landmarks (1,000 and 256 floats an item at sdsrl's defaults, where the gallery
    holds 640). The complement because a kernel value of a nearby landmark is close to 1,
    where float16's spacing (2^-11) is coarse, while ``1 - k`` is small and keeps 11
    significant bits; ``1 - (1 - k)`` is exact in float32 for every float16 ``1 - k`` in
    [0, 1], so keeping restored rows again changes nothing. Each kept value is within
    ``u |d| + 2^-25`` of its float32 complement ``d`` (``u = 2^-11``), which bounds a row's
    error by ``u / (1 - u) ||kept row|| + 2^-25 sqrt(width)`` (:meth:`kept_error`).
    """

    inputs: FeatureMap | None
    landmarks: F64
    gamma: float
    key: tuple[object, ...] = field(init=False)
    #: Kernel rows are wider than the gallery's own rows: a large gallery keeps them in
    #: float16 (half the bytes; docs/benchmarks.md has the sizes).
    compact_from_rows: ClassVar[int | None] = 250_000
    _norms: F64 = field(init=False, repr=False)  # the landmarks' squared norms

    def __post_init__(self) -> None:
        below = self.inputs.key if self.inputs is not None else ()
        object.__setattr__(
            self, "key", ("rbf", self.gamma, len(self.landmarks), _digest(self.landmarks), *below)
        )
        object.__setattr__(self, "_norms", squared_norms(self.landmarks))

    def own_work(self, rows: int, width: int) -> Work:
        return gemm(rows, len(self.landmarks), width) + elementwise(
            rows * len(self.landmarks), flops_per_item=20.0
        )  # the exponential

    def keep(self, features: F32) -> NDArray[np.floating]:
        out = np.empty(features.shape, dtype=np.float16)
        for at in range(0, len(features), _ROWS):
            out[at : at + _ROWS] = 1.0 - features[at : at + _ROWS]
        return out

    def restore(
        self, kept: NDArray[np.floating], dtype: type[np.floating] = np.float32
    ) -> NDArray[np.floating]:
        if kept.dtype != np.float16:
            return np.asarray(kept, dtype=dtype)
        return np.asarray(np.subtract(dtype(1.0), kept, dtype=dtype))

    def kept_error(self, kept: NDArray[np.floating]) -> float:
        if kept.dtype != np.float16 or not kept.size:
            return 0.0
        largest = max(
            float(np.einsum("ij,ij->i", part, part, dtype=np.float64).max())
            for part in (
                kept[at : at + _ROWS].astype(np.float32) for at in range(0, len(kept), _ROWS)
            )
        )
        return float(
            _HALF_U / (1 - _HALF_U) * np.sqrt(largest) + _HALF_SUBNORMAL * np.sqrt(kept.shape[1])
        )

    def apply(self, x: F32, landmarks: F64 | None = None) -> F32:
        norms: F64 | None = self._norms if landmarks is None else None
        landmarks = self.landmarks if landmarks is None else landmarks
        out = np.empty((len(x), len(landmarks)), dtype=np.float32)
        for at in range(0, len(x), _ROWS):
            out[at : at + _ROWS] = rbf_kernel(x[at : at + _ROWS], landmarks, self.gamma, norms)
        return out

    def extend(self, kept: Mapping[tuple[object, ...], F32], x: F32) -> F32 | None:
        """The kernel rows to the landmarks from those to a kept map's landmarks when these
        start with them (only the new columns are computed): sdsrl's provisional landmarks
        are its whole pool, which grows, until the pool reaches ``m``."""
        best_rows, best = 0, None
        for key, values in kept.items():
            rows = key[2] if len(key) > 4 and key[0] == "rbf" else None
            if (
                not isinstance(rows, int)
                or key[1] != self.gamma
                or key[4:] != self.key[4:]
                or not best_rows < rows < len(self.landmarks)
            ):
                continue
            if _digest(self.landmarks[:rows]) == key[3]:
                best_rows, best = rows, values
        if best is None:
            return None
        return np.hstack([self.restore(best), self.apply(x, self.landmarks[best_rows:])])


def _digest(rows: F64) -> str:
    return hashlib.blake2b(
        np.ascontiguousarray(rows, dtype=np.float64).tobytes(), digest_size=12
    ).hexdigest()


@dataclass(frozen=True, eq=False)
class LinearHead:
    """An embedding ``finish(features(x) @ weight + bias)``.

    Parameters
    ----------
    features
        The version-independent map (``None``: the unit rows).
    weight
        ``(features, k)``, this version's.
    bias
        ``(k,)`` or ``None``.
    finish
        ``"l2"`` (rows L2-normalised, a zero row stays zero), ``"softmax"`` or ``"none"``.
    """

    features: FeatureMap | None
    weight: F64
    bias: F64 | None
    finish: Literal["none", "l2", "softmax"]

    @property
    def key(self) -> tuple[object, ...]:
        return self.features.key if self.features is not None else ()

    def embed(self, features: NDArray[np.floating]) -> F32:
        """The embeddings of rows whose features are ``features``, float32 or as a server
        keeps them (:meth:`FeatureMap.keep`); products in float64."""
        fmap = self.features if self.features is not None else FeatureMap()
        out = np.empty((len(features), self.weight.shape[1]), dtype=np.float32)
        for at in range(0, len(features), _ROWS):
            out[at : at + _ROWS] = self._finish(
                fmap.restore(features[at : at + _ROWS], np.float64) @ self.weight
            )
        return out

    def score_error(self, feature_error: float, query: NDArray[np.floating]) -> float:
        """How far an embedding's inner product with ``query`` can move when its features
        move by at most ``feature_error`` (L2): ``feature_error ||W query||`` (Cauchy-Schwarz),
        for a head without a finish (a finish would bend the error: not derived)."""
        if feature_error == 0.0:
            return 0.0
        if self.finish != "none":
            raise ValueError(f"no error bound through a {self.finish!r} finish")
        return feature_error * float(np.linalg.norm(self.weight @ np.asarray(query, np.float64)))

    def embed_float32(self, features: F32) -> F32:
        """:meth:`embed` with the product in float32: no float64 copy of ``features``, for
        scores only compared with one another (the rolling evaluation's), where float32
        rounding of the product does not matter."""
        return self._finish(features @ self.weight.astype(np.float32)).astype(np.float32)

    def _finish(self, z: NDArray[np.floating]) -> NDArray[np.floating]:
        if self.bias is not None:
            z = z + self.bias
        if self.finish == "l2":
            return power_normalize(z)
        if self.finish == "softmax":
            z = np.exp(z - z.max(axis=1, keepdims=True))
            return np.asarray(z / z.sum(axis=1, keepdims=True))
        return z


def unit_features(fmap: FeatureMap | None, x: NDArray[np.floating]) -> F32:
    """``fmap``'s features of vectors (one, or rows), from their unit rows (as a gallery keeps
    them; a zero row stays zero)."""
    rows = np.atleast_2d(np.asarray(x, dtype=np.float32))
    norms = np.sqrt(np.einsum("ij,ij->i", rows, rows, dtype=np.float64))[:, None]
    # Divided in float32, as every float32 row is divided by its norm here (the same bits).
    unit: F32 = np.divide(rows, np.where(norms > 0, norms, 1.0).astype(np.float32))
    return unit if fmap is None else fmap(unit)


class SlotFeatures:
    """Features of a history's stored pairs under a head's feature map, one row per slot,
    kept until the slot is written again or the map changes: the rolling evaluation scores the
    newest stored pairs at each evaluated pair, and their features do not change between the
    model's versions. The rows gone stale since the last call are computed together, one
    matrix product (at 4096-d a kernel map's landmarks are tens of MB, read once a batch
    instead of once a row). Derived, never checkpointed: a restored learner computes its
    first gallery in one batch where the original computed it in several, which can move a
    feature by float32 rounding; that reaches the gauge's scores, never the model."""

    def __init__(self) -> None:
        self._kept: dict[str, tuple[tuple[object, ...], F32, NDArray[np.int64]]] = {}

    def features(
        self, fmap: FeatureMap | None, modality: str, history: History, rows: NDArray[np.intp]
    ) -> F32:
        """The features of the pairs stored at ``rows`` (a copy, in their order)."""
        return self._current(fmap, modality, history, rows)[rows]

    def runs(
        self, fmap: FeatureMap | None, modality: str, history: History, rows: NDArray[np.intp]
    ) -> list[F32]:
        """:meth:`features` in pieces whose concatenation is the rows' features: one view of
        the kept rows per run of consecutive slots when there are at most two, as the ring's
        newest pairs are in any rotation (nothing copied); otherwise one gathered copy."""
        values = self._current(fmap, modality, history, rows)
        breaks = np.flatnonzero(np.diff(rows) != 1) + 1
        if len(breaks) > 1 or not len(rows):
            return [values[rows]]
        return [values[int(run[0]) : int(run[-1]) + 1] for run in np.split(rows, breaks)]

    def _current(
        self, fmap: FeatureMap | None, modality: str, history: History, rows: NDArray[np.intp]
    ) -> F32:
        """The kept features, one row per slot, with those of ``rows`` made current."""
        stored = history.img if modality == "image" else history.txt
        key = fmap.key if fmap is not None else ()
        kept = self._kept.get(modality)
        if kept is None or kept[0] != key or len(kept[2]) != history.capacity:
            width = unit_features(fmap, stored[0]).shape[1]
            kept = (
                key,
                np.zeros((history.capacity, width), dtype=np.float32),
                np.zeros(history.capacity, dtype=np.int64),
            )  # versions start at 1
            self._kept[modality] = kept
        _, values, versions = kept
        stale = np.unique(rows[versions[rows] != history.versions[rows]])
        if len(stale):
            values[stale] = unit_features(fmap, stored[stale])
            versions[stale] = history.versions[stale]
        return values
