"""The alternation of SCSM (Liang et al., SIGIR 2016, Sec. 2.3-2.4, Algorithm 1) on one set of
pairs: self-paced weights ``v``, projections ``U_a``, ``U_b`` and the group indicator ``Y``.

Notation (rows are samples here, the paper's columns): ``X_p`` (n x d_p) with a constant
feature appended, ``Z_p = X_p U_p`` (n x c), ``y`` the group of each pair (``Y`` one-hot), ``v``
0/1. Eq. 14 is

    J = sum_i v_i (||Z_a,i - e_y_i||^2 + ||Z_b,i - e_y_i||^2)
        + alpha Tr(Z' L Z) + beta (||U_a||^2 + ||U_b||^2) - lam sum_i v_i

with ``lam = 1/k`` (the age) and ``L`` the Laplacian of the joint graph of Eq. 10:
``gamma W_a`` and ``gamma W_b`` (r-nearest-neighbour Gaussian graphs) on the diagonal blocks,
``Y'Y`` between the modalities. ``Tr(Z'LZ)`` is ``gamma (G(W_a, Z_a) + G(W_b, Z_b))`` plus
``sum_{i,j: y_i = y_j} ||Z_a,i - Z_b,j||^2``, with ``G(W, Z) = 1/2 sum_ij W_ij ||Z_i - Z_j||^2``:
the cross block's degree terms are what turn ``-Y'Y`` into distances. Every step below is an
exact minimisation of ``J`` over its block, so ``J`` never increases.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray
from scipy import sparse

__all__ = ["GroupSums", "Problem", "kmeans", "knn_graph"]

F64 = NDArray[np.float64]


def knn_graph(x: NDArray[np.floating], r: int) -> sparse.csr_matrix:
    """Symmetric r-nearest-neighbour graph with Gaussian weights ``exp(-d^2 / sigma^2)``
    (Eq. 7); an edge exists when either end is among the other's ``r`` nearest. ``sigma^2`` is
    the mean squared distance to the ``r``-th neighbour (the paper leaves the width open).

    >>> g = knn_graph(np.array([[0.0], [1.0], [5.0]]), r=1)
    >>> g.toarray().round(3)
    array([[0.   , 0.846, 0.   ],
           [0.846, 0.   , 0.069],
           [0.   , 0.069, 0.   ]])
    """
    x = np.asarray(x, dtype=np.float64)
    n = len(x)
    r = min(r, n - 1)
    if r < 1:
        return sparse.csr_matrix((n, n))
    sq = np.einsum("ij,ij->i", x, x)
    d2 = np.maximum(sq[:, None] + sq[None, :] - 2 * x @ x.T, 0.0)
    np.fill_diagonal(d2, np.inf)
    nn = np.argpartition(d2, r - 1, axis=1)[:, :r]
    rows = np.repeat(np.arange(n), r)
    dist = d2[rows, nn.ravel()]
    sigma2 = float(np.mean(np.max(d2[np.arange(n)[:, None], nn], axis=1)))
    w = np.exp(-dist / max(sigma2, 1e-12))
    g = sparse.csr_matrix((w, (rows, nn.ravel())), shape=(n, n))
    return g.maximum(g.T).tocsr()


def laplacian(w: sparse.csr_matrix) -> sparse.csr_matrix:
    return (sparse.diags(np.asarray(w.sum(axis=1)).ravel()) - w).tocsr()


def kmeans(x: NDArray[np.floating], k: int, rng: np.random.Generator, iterations: int = 50,
           restarts: int = 3) -> NDArray[np.int64]:
    """Lloyd's k-means, the best (least within-cluster sum of squares) of ``restarts``
    k-means++ starts; an emptied cluster takes the farthest point.

    >>> x = np.array([[0.0], [0.1], [5.0], [5.1]])
    >>> labels = kmeans(x, 2, np.random.default_rng(0))
    >>> bool(labels[0] == labels[1] != labels[2] == labels[3])
    True
    """
    data = np.asarray(x, dtype=np.float64)
    best, best_sse = np.zeros(len(data), dtype=np.int64), np.inf
    for _ in range(restarts):
        labels, sse = _lloyd(data, k, rng, iterations)
        if sse < best_sse:
            best, best_sse = labels, sse
    return best


def _lloyd(x: F64, k: int, rng: np.random.Generator,
           iterations: int) -> tuple[NDArray[np.int64], float]:
    n = len(x)
    centres = [x[rng.integers(n)]]
    for _ in range(1, k):
        d2 = np.min([np.sum((x - c) ** 2, axis=1) for c in centres], axis=0)
        total = d2.sum()
        centres.append(x[rng.choice(n, p=d2 / total)] if total > 0 else x[rng.integers(n)])
    c = np.array(centres)
    labels = np.zeros(n, dtype=np.int64)
    for it in range(iterations):
        d2 = np.sum(x * x, 1)[:, None] + np.sum(c * c, 1)[None, :] - 2 * x @ c.T
        new = np.argmin(d2, axis=1)
        for j in range(k):
            members = new == j
            if not members.any():
                far = int(np.argmax(np.min(d2, axis=1)))
                new[far] = j
                members = new == j
            c[j] = x[members].mean(axis=0)
        if it and np.array_equal(new, labels):
            break
        labels = new
    sse = float(np.sum((x - c[labels]) ** 2))
    return labels, sse


def nearest_centroid(x: NDArray[np.floating], groups_of: NDArray[np.int64], k: int,
                     rows: NDArray[np.bool_]) -> NDArray[np.int64]:
    """For the ``rows`` of ``x``, the group (of ``groups_of``, < 0 = none) whose centroid is
    nearest; groups without a member are skipped."""
    x = np.asarray(x, dtype=np.float64)
    d2 = np.full((int(rows.sum()), k), np.inf)
    for j in range(k):
        members = groups_of == j
        if members.any():
            d2[:, j] = np.sum((x[rows] - x[members].mean(axis=0)) ** 2, axis=1)
    return np.asarray(np.argmin(d2, axis=1), dtype=np.int64)


@dataclass
class GroupSums:
    """Per group: member count ``n``, sums of the projections ``sa``, ``sb`` and of their
    squared norms ``qa``, ``qb``; enough for every cross-block distance sum of a group."""

    n: F64
    sa: F64
    sb: F64
    qa: F64
    qb: F64

    @classmethod
    def of(cls, y: NDArray[np.int64], za: F64, zb: F64, groups: int) -> GroupSums:
        sums = cls(np.bincount(y, minlength=groups).astype(np.float64),
                   np.zeros((groups, za.shape[1])), np.zeros((groups, zb.shape[1])),
                   np.zeros(groups), np.zeros(groups))
        np.add.at(sums.sa, y, za)
        np.add.at(sums.sb, y, zb)
        np.add.at(sums.qa, y, np.einsum("ij,ij->i", za, za))
        np.add.at(sums.qb, y, np.einsum("ij,ij->i", zb, zb))
        return sums

    def move(self, za_i: F64, zb_i: F64, old: int, new: int) -> None:
        """One pair leaves group ``old`` for ``new``."""
        for key, value in (("n", 1.0), ("sa", za_i), ("sb", zb_i), ("qa", float(za_i @ za_i)),
                           ("qb", float(zb_i @ zb_i))):
            getattr(self, key)[old] -= value
            getattr(self, key)[new] += value


@dataclass
class Problem:
    """One set of pairs and the state of the alternation on it.

    ``alpha``, ``gamma``, ``beta`` are the paper's weights as they enter ``J``; the model
    (:class:`~streamxm.models.scsm.SCSM`) scales them with the number of pairs.
    """

    xa: F64
    xb: F64
    groups: int
    alpha: float
    gamma: float
    beta: float
    r: int
    y: NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    ua: F64 = field(default_factory=lambda: np.zeros((0, 0)))
    ub: F64 = field(default_factory=lambda: np.zeros((0, 0)))
    v: NDArray[np.bool_] = field(default_factory=lambda: np.zeros(0, dtype=bool))
    lam: float = 0.0

    def __post_init__(self) -> None:
        self.la = laplacian(knn_graph(self.xa, self.r))
        self.lb = laplacian(knn_graph(self.xb, self.r))
        n = len(self.xa)
        if self.y.shape != (n,):
            self.y = np.zeros(n, dtype=np.int64)
        if self.v.shape != (n,):
            self.v = np.ones(n, dtype=bool)
        if self.ua.shape != (self.xa.shape[1], self.groups):
            self.ua = np.zeros((self.xa.shape[1], self.groups))
        if self.ub.shape != (self.xb.shape[1], self.groups):
            self.ub = np.zeros((self.xb.shape[1], self.groups))

    # -- the objective ---------------------------------------------------------------------
    def projections(self) -> tuple[F64, F64]:
        return self.xa @ self.ua, self.xb @ self.ub

    def sample_losses(self) -> F64:
        """``||Z_a,i - e_y_i||^2 + ||Z_b,i - e_y_i||^2`` per pair."""
        za, zb = self.projections()
        rows = np.arange(len(self.y))
        ea, eb = za.copy(), zb.copy()
        ea[rows, self.y] -= 1.0
        eb[rows, self.y] -= 1.0
        return np.asarray(np.einsum("ij,ij->i", ea, ea) + np.einsum("ij,ij->i", eb, eb))

    def cross_term(self, za: F64, zb: F64) -> float:
        """``sum_{i,j: y_i = y_j} ||Z_a,i - Z_b,j||^2`` from per-group sums."""
        total = 0.0
        for c in range(self.groups):
            m = self.y == c
            nc = int(m.sum())
            if nc:
                sa, sb = za[m].sum(axis=0), zb[m].sum(axis=0)
                total += nc * (float(np.sum(za[m] ** 2)) + float(np.sum(zb[m] ** 2)))
                total -= 2.0 * float(sa @ sb)
        return total

    def objective(self) -> float:
        """Eq. 14 (with ``lam = 1/k``)."""
        za, zb = self.projections()
        graph = self.gamma * (float(np.sum(za * (self.la @ za)))
                              + float(np.sum(zb * (self.lb @ zb))))
        fit = float(np.sum(self.sample_losses()[self.v]))
        reg = self.beta * (float(np.sum(self.ua ** 2)) + float(np.sum(self.ub ** 2)))
        return (fit + self.alpha * (graph + self.cross_term(za, zb)) + reg
                - self.lam * float(self.v.sum()))

    # -- the steps ---------------------------------------------------------------------------
    def update_v(self) -> None:
        """Eq. 13: a pair enters when its loss is below the age threshold ``lam = 1/k``."""
        self.v = self.sample_losses() < self.lam

    def update_u(self, modality: str) -> None:
        """Eq. 16 for one modality, the other fixed: the normal equations
        ``(X'VX + alpha gamma X'L_p X + alpha X'N X + beta I) U = X'V E + alpha X' S_other[y]``,
        ``N`` the diagonal of group sizes (the cross block's degrees) and ``S_other[c]`` the sum
        of the other modality's projections over group ``c`` (``-Y'Y`` times them)."""
        if modality == "image":
            x, lp, other = self.xa, self.la, self.xb @ self.ub
        else:
            x, lp, other = self.xb, self.lb, self.xa @ self.ua
        n_group = np.bincount(self.y, minlength=self.groups).astype(np.float64)
        s_other = np.zeros((self.groups, other.shape[1]))
        np.add.at(s_other, self.y, other)
        vx = x * self.v[:, None]
        lhs = (vx.T @ x + self.alpha * self.gamma * (x.T @ (lp @ x))
               + self.alpha * (x * n_group[self.y][:, None]).T @ x
               + self.beta * np.eye(x.shape[1]))
        e = np.zeros((len(self.y), self.groups))
        e[np.arange(len(self.y)), self.y] = 1.0
        rhs = vx.T @ e + self.alpha * x.T @ s_other[self.y]
        u = np.linalg.solve(lhs, rhs)
        if modality == "image":
            self.ua = u
        else:
            self.ub = u

    def group_sums(self, za: F64, zb: F64) -> GroupSums:
        return GroupSums.of(self.y, za, zb, self.groups)

    def column_costs(self, i: int, za: F64, zb: F64, sums: GroupSums) -> F64:
        """``J`` as a function of pair ``i``'s group (up to a constant): the fit term and the
        cross-block distances ``sum_{j in c, j != i} ||Z_a,i - Z_b,j||^2 + ||Z_a,j - Z_b,i||^2``
        to the other members of each group ``c``, from the group sums."""
        na2, nb2 = float(za[i] @ za[i]), float(zb[i] @ zb[i])
        cross = (sums.n * (na2 + nb2) - 2.0 * (sums.sb @ za[i]) - 2.0 * (sums.sa @ zb[i])
                 + sums.qa + sums.qb)
        # Pair i's own group counts it among the members: take its own term back out.
        cross[self.y[i]] -= 2.0 * float(np.sum((za[i] - zb[i]) ** 2))
        fit = -2.0 * (za[i] + zb[i]) if self.v[i] else np.zeros(self.groups)
        return np.asarray(fit + self.alpha * cross)

    def update_y(self, sweeps: int = 2) -> int:
        """Eq. 21-22 from the full objective: each pair in turn moves to the group of least
        ``J`` given all others (group sums kept current); returns how many moves were made."""
        za, zb = self.projections()
        sums = self.group_sums(za, zb)
        moves = 0
        for _ in range(sweeps):
            moved = 0
            for i in range(len(self.y)):
                costs = self.column_costs(i, za, zb, sums)
                old, new = int(self.y[i]), int(np.argmin(costs))
                if new == old or costs[new] >= costs[old]:
                    continue
                sums.move(za[i], zb[i], old, new)
                self.y[i] = new
                moved += 1
            moves += moved
            if not moved:
                break
        return moves

    def refill_empty_groups(self) -> int:
        """Guard: an empty group takes the pair of largest loss from a group of two or more.

        Not a minimisation step (it may raise ``J``); without it a group that loses its last
        pair never regains one, since its projection column is regressed to zero. Returns the
        number of groups refilled.
        """
        refilled = 0
        for c in range(self.groups):
            sizes = np.bincount(self.y, minlength=self.groups)
            if sizes[c] or len(self.y) < self.groups:
                continue
            losses = np.where(sizes[self.y] > 1, self.sample_losses(), -np.inf)
            self.y[int(np.argmax(losses))] = c
            refilled += 1
        return refilled

    def start(self, rng: np.random.Generator, init: NDArray[np.int64] | None = None) -> None:
        """Algorithm 1's initialisation: ``Y`` by k-means on the texts, or, warm, the groups of
        ``init`` with its unplaced pairs (< 0) put in the group of the nearest text centroid;
        ``U`` from two rounds of Eq. 16 with every pair in; the age threshold ``lam`` at the
        median pair loss, so half the pairs start in."""
        if init is None:
            self.y = kmeans(self.xb[:, :-1], self.groups, rng)
        else:
            self.y = np.array(init, dtype=np.int64)
            new = self.y < 0
            if new.any():
                self.y[new] = nearest_centroid(self.xb[:, :-1], init, self.groups, new)
        self.v = np.ones(len(self.y), dtype=bool)
        for _ in range(2):
            self.update_u("image")
            self.update_u("text")
        self.lam = float(np.median(self.sample_losses()))

    def iterate(self, growth: float, sweeps: int = 2) -> dict[str, float]:
        """One outer iteration: v (Eq. 13), U_a, U_b (Eq. 16), Y (Eq. 21-22), the empty-group
        guard, then the age grows (``lam *= growth``: more pairs enter). Returns ``J`` after
        each step, for the objective curve."""
        trace = {}
        self.update_v()
        trace["v"] = self.objective()
        self.update_u("image")
        self.update_u("text")
        trace["u"] = self.objective()
        trace["moves"] = float(self.update_y(sweeps))
        trace["y"] = self.objective()
        trace["refilled"] = float(self.refill_empty_groups())
        self.lam *= growth
        trace["age"] = self.objective()
        trace["included"] = float(self.v.mean())
        return trace
