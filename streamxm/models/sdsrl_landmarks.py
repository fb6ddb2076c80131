"""SDSRL's landmarks: the Nystroem maps drawn from the pool of arriving pairs, and their arrays.

Jiang, Li, Li and Wang, "Learning Discriminative Representations for Semantic Cross Media
Retrieval" (SDSRL), Sec. 3: the kernel features ``phi`` and ``psi`` of Eq. 5.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray

from streamxm.models.array_types import F64
from streamxm.models.base import Arrays, CrossModalModel
from streamxm.models.classes import ClassIndex
from streamxm.models.heads import rbf_kernel, squared_norms
from streamxm.models.history import Example
from streamxm.models.moments import power_normalize

__all__ = [
    "STATISTICS",
    "LandmarkStatistics",
    "NystroemMap",
    "draw_map",
    "draw_picks",
    "map_arrays",
    "restore_maps",
]


#: The running statistics' attributes: ``Phi'Phi``, ``Psi'Psi``, ``Phi'L`` and ``Psi'L``.
STATISTICS = ("gram_img", "gram_txt", "lab_img", "lab_txt")


class NystroemMap:
    """Explicit features ``phi(x) = k(x, landmarks) U diag(w)^-1/2`` with ``K_mm = U diag(w) U'``,
    so that ``phi(x)'phi(y)`` approximates ``k(x, y)`` (exactly on the landmarks).

    Eigenvalues below ``floor`` times the largest are dropped: with ``sigma = 1`` on L2-normalised
    vectors the kernel is nearly linear and ``K_mm`` numerically singular, and dividing by those
    eigenvalues would only amplify rounding. The feature count is the number of eigenvalues kept.

    >>> rng = np.random.default_rng(0)
    >>> pts = rng.normal(size=(5, 3))
    >>> nm = NystroemMap(pts, gamma=0.5)
    >>> f = nm.features(pts)
    >>> bool(np.allclose(f @ f.T, rbf_kernel(pts, pts, 0.5)))
    True
    """

    def __init__(
        self,
        landmarks: NDArray[np.floating],
        gamma: float,
        floor: float = 1e-10,
        proj: F64 | None = None,
    ) -> None:
        self.landmarks = np.asarray(landmarks, dtype=np.float64)
        self.gamma = float(gamma)
        if proj is None:
            w, u = np.linalg.eigh(rbf_kernel(self.landmarks, self.landmarks, self.gamma))
            keep = w > floor * w.max()
            proj = u[:, keep] / np.sqrt(w[keep])
        self.proj = np.asarray(proj, dtype=np.float64)
        self.landmark_norms = squared_norms(self.landmarks)

    @property
    def dim(self) -> int:
        return int(self.proj.shape[1])

    def kernel(self, x: NDArray[np.floating]) -> F64:
        return rbf_kernel(np.atleast_2d(x), self.landmarks, self.gamma, self.landmark_norms)

    def features(self, x: NDArray[np.floating]) -> F64:
        return self.kernel(x) @ self.proj


def draw_picks(pool: int, m: int, rng: np.random.Generator) -> NDArray[np.intp]:
    """``min(m, pool)`` indices of a pool of ``pool`` rows drawn without replacement, sorted.

    >>> draw_picks(5, 3, np.random.default_rng(0)).tolist()
    [2, 3, 4]
    """
    return np.sort(rng.choice(pool, size=min(m, pool), replace=False))


def draw_map(rows: list[F64], m: int, gamma: float, rng: np.random.Generator) -> NystroemMap:
    """The map on ``min(m, len(rows))`` landmarks drawn from the pooled ``rows`` without
    replacement (kept in pool order; :func:`draw_picks`).

    >>> pool = list(np.eye(4))
    >>> nm = draw_map(pool, 2, 1.0, np.random.default_rng(0))
    >>> nm.landmarks.shape, nm.dim
    ((2, 4), 2)
    """
    return NystroemMap(np.asarray(rows)[draw_picks(len(rows), m, rng)], gamma)


def map_arrays(prefix: str, img: NystroemMap | None, txt: NystroemMap | None) -> Arrays:
    """The arrays that :func:`restore_maps` rebuilds the two maps from: each side's landmarks
    and projection, under ``{prefix}landmarks_img``, ``{prefix}proj_img`` and the ``_txt``
    likewise (the projection is stored, not recomputed from the landmarks); none for a side
    without a map."""
    arrays: Arrays = {}
    for side, nm in (("img", img), ("txt", txt)):
        if nm is not None:
            arrays[f"{prefix}landmarks_{side}"] = nm.landmarks
            arrays[f"{prefix}proj_{side}"] = nm.proj
    return arrays


def restore_maps(
    arrays: Arrays, prefix: str, gamma_img: float, gamma_txt: float
) -> tuple[NystroemMap, NystroemMap]:
    """The image and text maps that :func:`map_arrays` wrote under ``prefix``."""
    img, txt = (
        NystroemMap(arrays[f"{prefix}landmarks_{side}"], gamma, proj=arrays[f"{prefix}proj_{side}"])
        for side, gamma in (("img", gamma_img), ("txt", gamma_txt))
    )
    return img, txt


class LandmarkStatistics(CrossModalModel):
    """What SDSRL folds the stream into, a base of :class:`~streamxm.models.sdsrl.SDSRL`: the
    pairs pending (the landmark pool until the landmarks freeze, then a batch), the Nystroem
    maps drawn from them, and the forgetting-weighted statistics of their features. Reads the
    settings that SDSRL's constructor sets."""

    power_img: float
    power_txt: float
    m_img: int
    m_txt: int
    sigma_img: float
    sigma_txt: float
    mu: float
    forget: float
    grow_landmarks: float
    landmark_pool: int
    q: int
    class_index: ClassIndex
    a: F64
    b: F64

    def __init__(self, img_dim: int, txt_dim: int) -> None:
        super().__init__(img_dim, txt_dim)
        # Pairs not yet folded into the statistics: the landmark pool, then a batch.
        self.pending_img: list[F64] = []
        self.pending_txt: list[F64] = []
        self.pending_cols: list[list[int]] = []
        self.frozen = False
        self.map_img: NystroemMap | None = None
        self.map_txt: NystroemMap | None = None
        self.gram_img = self.gram_txt = np.zeros((0, 0))
        self.lab_img = self.lab_txt = np.zeros((0, 0))
        self.weight = 0.0  # the (forgetting-weighted) pair count of the statistics
        self.pairs = 0
        self.unlabelled = 0
        # Landmarks per class column, each side (a landmark counts for each of its labels).
        self.landmark_classes_img = np.zeros(0, dtype=np.int64)
        self.landmark_classes_txt = np.zeros(0, dtype=np.int64)
        # The class columns known at the last growth over pending pairs: the classes after them
        # are owed growth (:attr:`owes_growth`).
        self.grown_classes = 0
        # Set through a round split among ranks: their landmark sets stay equal (no growth).
        self.hold_growth = False

    def _add(self, pair: Example) -> None:
        self.pending_img.append(power_normalize(pair.img, self.power_img))
        self.pending_txt.append(power_normalize(pair.txt, self.power_txt))
        self.pending_cols.append(self.class_index.columns(pair.labels))
        self.pairs += 1
        self.unlabelled += not pair.labels

    def _freeze(self, rng: np.random.Generator) -> None:
        """The landmarks drawn from the whole pool for good, the pool folded and dropped."""
        self._redraw(rng)
        self.frozen = True
        self.pending_img, self.pending_txt, self.pending_cols = [], [], []

    def _redraw(self, rng: np.random.Generator) -> None:
        """Landmarks drawn from the pool (the pairs pending), the statistics rebuilt on them."""
        pool = len(self.pending_img)
        pick_img = draw_picks(pool, self.m_img, rng)
        pick_txt = draw_picks(pool, self.m_txt, rng)
        self.map_img = NystroemMap(np.asarray(self.pending_img)[pick_img], self.sigma_img)
        self.map_txt = NystroemMap(np.asarray(self.pending_txt)[pick_txt], self.sigma_txt)
        self.landmark_classes_img = self._class_counts(pick_img)
        self.landmark_classes_txt = self._class_counts(pick_txt)
        self.gram_img = np.zeros((self.map_img.dim, self.map_img.dim))
        self.gram_txt = np.zeros((self.map_txt.dim, self.map_txt.dim))
        self.lab_img = np.zeros((self.map_img.dim, 0))
        self.lab_txt = np.zeros((self.map_txt.dim, 0))
        self.weight = 0.0
        self.a = np.zeros((0, self.q))  # the projections start afresh on new landmarks
        self.b = np.zeros((0, self.q))
        self._accumulate()

    def _class_counts(self, rows: NDArray[np.intp]) -> NDArray[np.int64]:
        """How many of the pending ``rows`` carry each class column."""
        counts = np.zeros(len(self.class_index), dtype=np.int64)
        for row in rows:
            counts[self.pending_cols[row]] += 1
        return counts

    @property
    def owes_growth(self) -> bool:
        """Whether a class became known after the last growth over pending pairs (landmarks
        growing, frozen; always false for a single learner right after a fold)."""
        return (
            self.frozen and self.grow_landmarks > 0 and self.grown_classes < len(self.class_index)
        )

    def _fold(self) -> None:
        """Add the pending pairs to the statistics and drop them (after the landmarks grow,
        :meth:`_grow`, where ``grow_landmarks`` asks for it and no split round holds them)."""
        if self.frozen and self.grow_landmarks > 0 and not self.hold_growth:
            self._grow()
        self._accumulate()
        self.pending_img, self.pending_txt, self.pending_cols = [], [], []

    def _grow(self) -> None:
        """Landmarks added from the pending pairs for the classes that the landmarks cover
        thinly, the statistics and the projections re-based onto the grown maps.

        A side of ``m`` landmarks at the freeze (``min(m_img, landmark_pool)``, and likewise
        for texts) owes each of the ``C`` classes seen so far
        ``ceil(grow_landmarks m / C)`` of them; a class with fewer gets the difference from the
        first pending pairs that carry it (so the ``k``-th class seen adds at most
        ``ceil(grow_landmarks m / k)``).
        The grown span contains the old one: with ``T = U_new' K(new, old) U_old`` (the
        Nystroem projections ``U``) the old features are ``T phi`` in the new coordinates, so
        ``Phi'Phi`` becomes ``T Phi'Phi T'``, ``Phi'L`` becomes ``T Phi'L`` and ``A`` becomes
        ``T A``: the pairs folded keep the features they had; the pairs to come get the larger
        span. The paper draws the landmarks once (``grow_landmarks = 0``). With pending pairs,
        the classes known now are no longer owed growth (:attr:`owes_growth`).
        """
        classes = len(self.class_index)
        if classes == 0:
            return
        if self.pending_cols:
            self.grown_classes = classes
        for side in ("img", "txt"):
            nm: NystroemMap | None = getattr(self, f"map_{side}")
            assert nm is not None
            m = min(self.m_img if side == "img" else self.m_txt, self.landmark_pool)
            counts = getattr(self, f"landmark_classes_{side}")
            counts = np.concatenate([counts, np.zeros(classes - len(counts), dtype=np.int64)])
            owed = math.ceil(self.grow_landmarks * m / classes)
            picked: list[int] = []
            for row, cols in enumerate(self.pending_cols):
                if any(counts[c] < owed for c in cols):
                    picked.append(row)
                    counts[cols] += 1
            setattr(self, f"landmark_classes_{side}", counts)
            if not picked:
                continue
            rows = np.asarray(getattr(self, f"pending_{side}"))[picked]
            grown = NystroemMap(np.vstack([nm.landmarks, rows]), nm.gamma)
            t = grown.proj.T @ nm.kernel(grown.landmarks) @ nm.proj
            setattr(self, f"map_{side}", grown)
            if side == "img":
                self.gram_img = t @ self.gram_img @ t.T
                self.lab_img = t @ self.lab_img
                if len(self.a) == nm.dim:
                    self.a = t @ self.a
            else:
                self.gram_txt = t @ self.gram_txt @ t.T
                self.lab_txt = t @ self.lab_txt
                if len(self.b) == nm.dim:
                    self.b = t @ self.b

    def _accumulate(self) -> None:
        """Add the pending pairs to the statistics (they stay pending), in arrival order (for
        the forgetting)."""
        if not self.pending_img:
            return
        assert self.map_img is not None and self.map_txt is not None
        phi = self.map_img.features(np.asarray(self.pending_img))
        psi = self.map_txt.features(np.asarray(self.pending_txt))
        labels = np.zeros((len(self.pending_cols), len(self.class_index)))
        for row, cols in enumerate(self.pending_cols):
            labels[row, cols] = 1.0
        n = len(phi)
        w = self.forget ** np.arange(n - 1, -1, -1, dtype=np.float64)
        decay = self.forget**n
        self._widen_labels(labels.shape[1])
        self.gram_img = decay * self.gram_img + (phi * w[:, None]).T @ phi
        self.gram_txt = decay * self.gram_txt + (psi * w[:, None]).T @ psi
        self.lab_img = decay * self.lab_img + (phi * w[:, None]).T @ labels
        self.lab_txt = decay * self.lab_txt + (psi * w[:, None]).T @ labels
        self.weight = decay * self.weight + float(w.sum())

    def _widen_labels(self, classes: int) -> None:
        """``Phi'L`` and ``Psi'L`` widened to ``classes`` columns (the new ones zero), copied
        even when none is new."""
        grow = classes - self.lab_img.shape[1]
        self.lab_img = np.hstack([self.lab_img, np.zeros((self.lab_img.shape[0], grow))])
        self.lab_txt = np.hstack([self.lab_txt, np.zeros((self.lab_txt.shape[0], grow))])

    def targets(self) -> tuple[F64, F64]:
        """``G = (Phi'Phi + mu n I)^-1 Phi'L`` and ``H`` likewise: ``M_I = GG'``, ``M_T = HH'``,
        ``M_C = GH'`` (Eq. 5 with ``S = LL'``)."""
        ridge = self.mu * self.weight
        g = np.linalg.solve(self.gram_img + ridge * np.eye(len(self.gram_img)), self.lab_img)
        h = np.linalg.solve(self.gram_txt + ridge * np.eye(len(self.gram_txt)), self.lab_txt)
        return np.asarray(g, dtype=np.float64), np.asarray(h, dtype=np.float64)
