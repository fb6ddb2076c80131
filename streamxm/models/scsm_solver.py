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
from typing import Any, Literal

import numpy as np
import scipy.linalg
from numpy.typing import NDArray
from scipy import sparse

from streamxm.models.array_types import F64
from streamxm.models.compiled import njit
from streamxm.models.work import Work, cholesky, elementwise, gemm, matvec, syrk

__all__ = [
    "GroupSums",
    "NormalEquations",
    "Problem",
    "ProblemWork",
    "kmeans",
    "knn_graph",
    "regroup",
]

Space = Literal["auto", "n", "d"]


def in_n_space(n: int, d: int, space: Space = "auto") -> bool:
    """Whether Eq. 16 is solved in sample space (``n x n``) rather than feature space
    (``d x d``): ``auto`` takes the smaller, ``n`` when ``d > n``."""
    return space == "n" or (space == "auto" and d > n)


def gram(x: NDArray[np.floating]) -> F64:
    """``X X'`` (numpy runs BLAS ``syrk`` on ``x @ x.T``: one triangle, mirrored, so the
    result is exactly symmetric)."""
    x = np.asarray(x, dtype=np.float64)
    return np.asarray(x @ x.T)


def knn_graph(x: NDArray[np.floating], r: int, gram_x: F64 | None = None) -> sparse.csr_matrix:
    """Symmetric r-nearest-neighbour graph with Gaussian weights ``exp(-d^2 / sigma^2)``
    (Eq. 7); an edge exists when either end is among the other's ``r`` nearest. ``sigma^2`` is
    the mean squared distance to the ``r``-th neighbour (the paper leaves the width open).
    ``d^2_ij = |x_i|^2 + |x_j|^2 - 2 G_ij`` from the Gram ``G = X X'`` (``gram_x``, computed
    when not given).

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
    nn, dist = _nearest(gram(x) if gram_x is None else gram_x, sq, r)
    sigma2 = float(np.mean(dist.max(axis=1)))
    w = np.exp(-dist.ravel() / max(sigma2, 1e-12))
    rows = np.repeat(np.arange(n), r)
    g = sparse.csr_matrix((w, (rows, nn.ravel())), shape=(n, n))
    return g.maximum(g.T).tocsr()


@njit(error_model="numpy", boundscheck=False)
def _nearest(g: F64, sq: F64, r: int) -> tuple[NDArray[np.int64], F64]:  # pragma: no cover
    """Per row ``i`` of the Gram ``g`` the ``r`` nearest other rows by
    ``d^2_ij = max(sq_i + sq_j - 2 g_ij, 0)`` and their squared distances, nearest first (a
    tie keeps the lower index). One pass over ``g``: the distance matrix is never formed."""
    n = len(sq)
    nn = np.empty((n, r), dtype=np.int64)
    dist = np.empty((n, r))
    for i in range(n):
        kept = 0
        for j in range(n):
            if j == i:
                continue
            d2 = max(sq[i] + sq[j] - 2.0 * g[i, j], 0.0)
            if kept == r and d2 >= dist[i, r - 1]:
                continue
            at = kept if kept < r else r - 1
            while at > 0 and dist[i, at - 1] > d2:
                dist[i, at] = dist[i, at - 1]
                nn[i, at] = nn[i, at - 1]
                at -= 1
            dist[i, at] = d2
            nn[i, at] = j
            kept = min(kept + 1, r)
    return nn, dist


def laplacian(w: sparse.csr_matrix) -> sparse.csr_matrix:
    return (sparse.diags(np.asarray(w.sum(axis=1)).ravel()) - w).tocsr()


def kmeans(
    x: NDArray[np.floating],
    k: int,
    rng: np.random.Generator,
    iterations: int = 50,
    restarts: int = 3,
) -> NDArray[np.int64]:
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


def _lloyd(
    x: F64, k: int, rng: np.random.Generator, iterations: int
) -> tuple[NDArray[np.int64], float]:
    n = len(x)
    centres = [x[rng.integers(n)]]
    for _ in range(1, k):
        d2 = np.min([np.sum((x - c) ** 2, axis=1) for c in centres], axis=0)
        total = d2.sum()
        centres.append(x[rng.choice(n, p=d2 / total)] if total > 0 else x[rng.integers(n)])
    c = np.array(centres)
    labels, c = _lloyd_steps(x, c, np.zeros(n, dtype=np.int64), iterations)
    sse = float(np.sum((x - c[labels]) ** 2))
    return labels, sse


def _lloyd_steps(
    x: F64, c: F64, labels: NDArray[np.int64], iterations: int
) -> tuple[NDArray[np.int64], F64]:
    """At most ``iterations`` Lloyd steps from the centres ``c`` (written into): each point
    to its nearest centre, then each centre to its members' mean; an emptied cluster takes
    the point farthest from its own centre. Stops early once the labels repeat."""
    for it in range(iterations):
        d2 = _squared_distances(x, c)
        new = np.argmin(d2, axis=1)
        for j in range(len(c)):
            members = new == j
            if not members.any():
                far = int(np.argmax(np.min(d2, axis=1)))
                new[far] = j
                members = new == j
            c[j] = x[members].mean(axis=0)
        if it and np.array_equal(new, labels):
            break
        labels = new
    return labels, c


def _squared_distances(x: F64, c: F64) -> F64:
    """``||x_i - c_j||^2`` for every row and centre, as ``n x k`` (no ``n x k x d`` array)."""
    return np.asarray(np.sum(x * x, 1)[:, None] + np.sum(c * c, 1)[None, :] - 2 * x @ c.T)


def regroup(
    x: NDArray[np.floating], labels: NDArray[np.int64], k: int, iterations: int
) -> NDArray[np.int64]:
    """``iterations`` Lloyd steps of k-means on ``x`` started from the groups of ``labels``
    (every row placed, ``0 <= label < k``): the groups keep their numbers and move to where
    the rows now are. A group without a member starts at the row farthest from the others'
    centres.

    >>> x = np.array([[0.0], [0.1], [5.0], [5.1]])
    >>> regroup(x, np.array([0, 0, 0, 1]), 2, 3).tolist()
    [0, 0, 1, 1]
    """
    data = np.asarray(x, dtype=np.float64)
    c = np.zeros((k, data.shape[1]))
    held = np.zeros(k, dtype=bool)
    for j in range(k):
        members = labels == j
        if members.any():
            c[j], held[j] = data[members].mean(axis=0), True
    for empty in np.flatnonzero(~held):
        d2 = _squared_distances(data, c[held])
        c[empty], held[empty] = data[int(np.argmax(np.min(d2, axis=1)))], True
    return _lloyd_steps(data, c, np.asarray(labels, dtype=np.int64), iterations)[0]


def nearest_centroid(
    x: NDArray[np.floating], groups_of: NDArray[np.int64], k: int, rows: NDArray[np.bool_]
) -> NDArray[np.int64]:
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
        sums = cls(
            np.bincount(y, minlength=groups).astype(np.float64),
            np.zeros((groups, za.shape[1])),
            np.zeros((groups, zb.shape[1])),
            np.zeros(groups),
            np.zeros(groups),
        )
        np.add.at(sums.sa, y, za)
        np.add.at(sums.sb, y, zb)
        np.add.at(sums.qa, y, np.einsum("ij,ij->i", za, za))
        np.add.at(sums.qb, y, np.einsum("ij,ij->i", zb, zb))
        return sums

    def move(self, za_i: F64, zb_i: F64, old: int, new: int) -> None:
        """One pair leaves group ``old`` for ``new``."""
        for key, value in (
            ("n", 1.0),
            ("sa", za_i),
            ("sb", zb_i),
            ("qa", float(za_i @ za_i)),
            ("qb", float(zb_i @ zb_i)),
        ):
            getattr(self, key)[old] -= value
            getattr(self, key)[new] += value


@dataclass(frozen=True)
class NormalEquations:
    """Eq. 16 for one modality with the parts that stay fixed during a solve precomputed.

    The system is ``A U = X'R`` with ``A = X'MX + beta I``, ``M = W + alpha gamma L`` (``W``
    the diagonal of weights ``w``, ``L`` the modality's Laplacian) and ``R`` an ``n x c``
    right-hand side (:meth:`Problem.update_u`). ``M`` is symmetric positive semi-definite
    (``L`` is a Laplacian of non-negative weights, ``w >= 0``) and ``beta > 0``, so ``A`` is
    symmetric positive definite. Two ways to solve it, equal in exact arithmetic:

    - **feature space** (``d x d``): ``A = (D X)'(D X) + alpha gamma X'LX + beta I`` with
      ``D = diag(sqrt(w))`` (one ``syrk``), factored by Cholesky (LU should rounding make it
      fail, as it can for a ``beta`` at rounding level); ``alpha gamma X'LX`` is computed
      once (``fixed``) and symmetrised, so ``A`` is exactly symmetric;
    - **sample space** (``n x n``, the push-through identity): ``X'(M X X' + beta I) =
      (X'MX + beta I) X'``, hence ``U = A^-1 X'R = X'(M G + beta I)^-1 R`` with the Gram
      ``G = X X'``. ``M G + beta I = W G + alpha gamma L G + beta I`` is not symmetric (LU),
      but is invertible: ``M G`` has the eigenvalues of ``G^1/2 M G^1/2 >= 0``.
      ``alpha gamma L G`` is computed once (``fixed``).
    """

    x: F64
    #: ``G = X X'`` in sample space, ``None`` in feature space.
    gram: F64 | None
    #: ``alpha gamma L G`` (``n x n``) or ``alpha gamma X'LX`` (``d x d``).
    fixed: F64
    #: The last weights' factorisation (:meth:`solve`); derived, never compared.
    _factor: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(
        cls, x: F64, lap: sparse.csr_matrix, alpha_gamma: float, gram_x: F64 | None
    ) -> NormalEquations:
        """Sample space when ``gram_x`` is given, feature space otherwise."""
        scaled = (alpha_gamma * lap).tocsr()
        if gram_x is not None:
            return cls(x, gram_x, np.asarray(scaled @ gram_x))
        xlx = np.asarray(x.T @ (scaled @ x))
        return cls(x, None, (xlx + xlx.T) * 0.5)

    def solve(self, w: F64, beta: float, r: F64) -> F64:
        """``U = (X' diag(w) X + alpha gamma X'LX + beta I)^-1 X'R``. The factorisation of
        the last ``(w, beta)`` is kept: :meth:`Problem.start`'s two rounds solve with the same
        weights, so the second round only substitutes."""
        key = (w.tobytes(), beta)
        if self._factor.get("key") != key:
            self._factor.clear()
            self._factor.update(key=key, factor=self._factorise(w, beta))
        kind, factor = self._factor["factor"]
        if kind == "lu":
            lu, piv = factor
            # ``lu`` factors K' (K's C-ordered buffer read in Fortran order): solve K' ' T = R.
            t, info = scipy.linalg.lapack.dgetrs(lu, piv, r, trans=1)
            if info:
                raise np.linalg.LinAlgError(f"dgetrs returned {info}")
            return np.asarray(self.x.T @ t)
        rhs = self.x.T @ r
        if kind == "cholesky":
            return np.asarray(scipy.linalg.cho_solve(factor, rhs, check_finite=False))
        return np.asarray(np.linalg.solve(factor, rhs))

    def _factorise(self, w: F64, beta: float) -> tuple[str, Any]:
        """Sample space: ``K = W G + alpha gamma L G + beta I`` by LU with partial pivoting
        (``dgetrf`` in place on ``K``'s buffer, read as ``K'`` in Fortran order: no copy).
        Feature space: ``A`` by Cholesky, or kept whole for an LU solve should Cholesky fail."""
        if self.gram is not None:
            k = self.gram * w[:, None]
            k += self.fixed
            k.flat[:: len(k) + 1] += beta
            lu, piv, info = scipy.linalg.lapack.dgetrf(k.T, overwrite_a=True)
            if info:  # > 0: exactly singular, as numpy.linalg.solve refuses it
                raise np.linalg.LinAlgError(f"dgetrf returned {info}")
            return "lu", (lu, piv)
        s = self.x * np.sqrt(w)[:, None]
        a = np.asarray(s.T @ s)  # syrk: exactly symmetric, so a.T (Fortran-ordered) is a
        a += self.fixed
        a.flat[:: len(a) + 1] += beta
        try:
            return "cholesky", scipy.linalg.cho_factor(a.T, check_finite=False)
        except np.linalg.LinAlgError:
            return "dense", a


@dataclass
class Problem:
    """One set of pairs and the state of the alternation on it.

    ``alpha``, ``gamma``, ``beta`` are the paper's weights as they enter ``J``; the model
    (:class:`~streamxm.models.scsm.SCSM`) scales them with the number of pairs. ``space`` picks
    how Eq. 16 is solved per modality (:class:`NormalEquations`; ``auto``: sample space when
    ``d > n``). ``X``, the graphs and the weights are fixed for the problem's life: what Eq. 16
    needs of them is computed once, on construction. ``U_a``, ``U_b`` are replaced, never
    written into: their projections are kept until they are (:meth:`projection`).
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
    space: Space = "auto"
    _kept: dict[str, tuple[F64, F64]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        ga, gb = gram(self.xa), gram(self.xb)
        self.la = laplacian(knn_graph(self.xa, self.r, ga))
        self.lb = laplacian(knn_graph(self.xb, self.r, gb))
        self.normal = {
            "image": self._normal_equations(self.xa, self.la, ga),
            "text": self._normal_equations(self.xb, self.lb, gb),
        }
        n = len(self.xa)
        if self.y.shape != (n,):
            self.y = np.zeros(n, dtype=np.int64)
        if self.v.shape != (n,):
            self.v = np.ones(n, dtype=bool)
        if self.ua.shape != (self.xa.shape[1], self.groups):
            self.ua = np.zeros((self.xa.shape[1], self.groups))
        if self.ub.shape != (self.xb.shape[1], self.groups):
            self.ub = np.zeros((self.xb.shape[1], self.groups))

    def _normal_equations(self, x: F64, lap: sparse.csr_matrix, g: F64) -> NormalEquations:
        n_space = in_n_space(len(x), x.shape[1], self.space)
        return NormalEquations.of(x, lap, self.alpha * self.gamma, g if n_space else None)

    # -- the objective ---------------------------------------------------------------------
    def projection(self, modality: str) -> F64:
        """``Z_p = X_p U_p``, computed once per ``U_p`` (kept until ``U_p`` is replaced; the
        result is shared, not to be written into)."""
        x, u = (self.xa, self.ua) if modality == "image" else (self.xb, self.ub)
        kept = self._kept.get(modality)
        if kept is None or kept[0] is not u:
            kept = (u, np.asarray(x @ u))
            self._kept[modality] = kept
        return kept[1]

    def projections(self) -> tuple[F64, F64]:
        return self.projection("image"), self.projection("text")

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
        graph = self.gamma * (
            float(np.sum(za * (self.la @ za))) + float(np.sum(zb * (self.lb @ zb)))
        )
        fit = float(np.sum(self.sample_losses()[self.v]))
        reg = self.beta * (float(np.sum(self.ua**2)) + float(np.sum(self.ub**2)))
        return (
            fit
            + self.alpha * (graph + self.cross_term(za, zb))
            + reg
            - self.lam * float(self.v.sum())
        )

    # -- the steps ---------------------------------------------------------------------------
    def update_v(self) -> None:
        """Eq. 13: a pair enters when its loss is below the age threshold ``lam = 1/k``."""
        self.v = self.sample_losses() < self.lam

    def update_u(self, modality: str) -> None:
        """Eq. 16 for one modality, the other fixed: the normal equations
        ``(X'VX + alpha gamma X'L_p X + alpha X'N X + beta I) U = X'V E + alpha X' S_other[y]``,
        ``N`` the diagonal of group sizes (the cross block's degrees) and ``S_other[c]`` the sum
        of the other modality's projections over group ``c`` (``-Y'Y`` times them). That is
        ``(X' diag(w) X + alpha gamma X'L_p X + beta I) U = X'R`` with ``w = v + alpha n_y``
        and ``R = V E + alpha S_other[y]`` (``n x c``), solved by :class:`NormalEquations`."""
        other = self.projection("text" if modality == "image" else "image")
        n_group = np.bincount(self.y, minlength=self.groups).astype(np.float64)
        s_other = np.zeros((self.groups, other.shape[1]))
        np.add.at(s_other, self.y, other)
        w = self.v + self.alpha * n_group[self.y]
        r = self.alpha * s_other[self.y]
        r[np.arange(len(self.y)), self.y] += self.v
        u = self.normal[modality].solve(w, self.beta, r)
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
        cross = (
            sums.n * (na2 + nb2)
            - 2.0 * (sums.sb @ za[i])
            - 2.0 * (sums.sa @ zb[i])
            + sums.qa
            + sums.qb
        )
        # Pair i's own group counts it among the members: take its own term back out.
        cross[self.y[i]] -= 2.0 * float(np.sum((za[i] - zb[i]) ** 2))
        fit = -2.0 * (za[i] + zb[i]) if self.v[i] else np.zeros(self.groups)
        return np.asarray(fit + self.alpha * cross)

    def update_y(self, sweeps: int = 2) -> int:
        """Eq. 21-22 from the full objective: each pair in turn moves to the group of least
        ``J`` given all others (group sums kept current); returns how many moves were made.

        Each pair's costs are :meth:`column_costs`; the sweep runs compiled
        (:func:`_sweep_groups`): the loop is sequential (a move changes the next pair's
        costs) and ``O(c^2)`` a pair, all interpreter overhead in Python."""
        za, zb = self.projections()
        sums = self.group_sums(za, zb)
        moves = 0
        for _ in range(sweeps):
            moved = int(
                _sweep_groups(
                    self.y, self.v, za, zb, sums.n, sums.sa, sums.sb, sums.qa, sums.qb, self.alpha
                )
            )
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

    def start(
        self,
        rng: np.random.Generator,
        init: NDArray[np.int64] | None = None,
        regroup_steps: int = 0,
    ) -> None:
        """Algorithm 1's initialisation: ``Y`` by k-means on the texts, or, warm, the groups of
        ``init`` with its unplaced pairs (< 0) put in the group of the nearest text centroid,
        then ``regroup_steps`` Lloyd steps of that k-means from these groups (:func:`regroup`);
        ``U`` from two rounds of Eq. 16 with every pair in; the age threshold ``lam`` at the
        median pair loss, so half the pairs start in."""
        if init is None:
            self.y = kmeans(self.xb[:, :-1], self.groups, rng)
        else:
            self.y = np.array(init, dtype=np.int64)
            new = self.y < 0
            if new.any():
                self.y[new] = nearest_centroid(self.xb[:, :-1], init, self.groups, new)
            if regroup_steps:
                self.y = regroup(self.xb[:, :-1], self.y, self.groups, regroup_steps)
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


@njit(error_model="numpy", boundscheck=False)
def _sweep_groups(
    y: NDArray[np.int64],
    v: NDArray[np.bool_],
    za: F64,
    zb: F64,
    n: F64,
    sa: F64,
    sb: F64,
    qa: F64,
    qb: F64,
    alpha: float,
) -> int:  # pragma: no cover - compiled
    """One sweep of :meth:`Problem.update_y` in place on ``y`` and the group sums: per pair
    the costs of :meth:`Problem.column_costs`, a move to the first group of least cost when
    it lowers the pair's cost. Returns the number of moves."""
    groups, width = sa.shape
    costs = np.empty(groups)
    moved = 0
    for i in range(len(y)):
        na2, nb2, own = 0.0, 0.0, 0.0
        for k in range(width):
            na2 += za[i, k] * za[i, k]
            nb2 += zb[i, k] * zb[i, k]
            own += (za[i, k] - zb[i, k]) ** 2
        for c in range(groups):
            dot_b, dot_a = 0.0, 0.0
            for k in range(width):
                dot_b += sb[c, k] * za[i, k]
                dot_a += sa[c, k] * zb[i, k]
            costs[c] = n[c] * (na2 + nb2) - 2.0 * dot_b - 2.0 * dot_a + qa[c] + qb[c]
        old = y[i]
        costs[old] -= 2.0 * own
        for c in range(groups):
            fit = -2.0 * (za[i, c] + zb[i, c]) if v[i] else 0.0
            costs[c] = fit + alpha * costs[c]
        new = int(np.argmin(costs))
        if new == old or costs[new] >= costs[old]:
            continue
        n[old] -= 1.0
        n[new] += 1.0
        for k in range(width):
            sa[old, k] -= za[i, k]
            sa[new, k] += za[i, k]
            sb[old, k] -= zb[i, k]
            sb[new, k] += zb[i, k]
        qa[old] -= na2
        qa[new] += na2
        qb[old] -= nb2
        qb[new] += nb2
        y[i] = new
        moved += 1
    return moved


@dataclass(frozen=True)
class ProblemWork:
    """The work of :class:`Problem`'s steps, counted from its sizes: ``n`` pairs, ``da``, ``db``
    features per modality (the constant included), ``c = groups``, ``r`` neighbours; all
    float64 (itemsize 8). Terms O(n c) or O(c^2) per step (group sums, masks, the fit
    residuals) are left out; the compiled per-pair loop of :meth:`Problem.update_y` is charged
    its ``O(c^2)`` arithmetic.

    The Laplacians are charged their largest size, ``nnz(L) = n (2 r + 1)``: an
    r-nearest-neighbour graph symmetrised by the maximum has at most ``2 n r`` edges (fewer when
    neighbours are mutual, which depends on the data), plus the diagonal.
    """

    n: int
    da: int
    db: int
    groups: int
    r: int

    @property
    def nnz(self) -> int:
        """``n (2 min(r, n - 1) + 1)``: the Laplacian's entries at most."""
        return self.n * (2 * max(min(self.r, self.n - 1), 0) + 1)

    def n_space(self, d: int) -> bool:
        """Whether :class:`Problem` (``space="auto"``) solves Eq. 16 in sample space."""
        return in_n_space(self.n, d)

    def graph(self, d: int) -> Work:
        """:func:`gram` and :func:`knn_graph` on ``n`` rows of ``d``: the squared norms
        (``2 n d``), the Gram (:func:`syrk`) and one pass over it for the ``r`` nearest
        (``sq_i + sq_j - 2 G`` and its ``max(., 0)``: 4 flops an entry; the insertions into
        the ``r`` kept are rare and not counted)."""
        n = self.n
        return Work(2.0 * n * d, 8.0 * n * d) + syrk(n, d) + elementwise(n * n, flops_per_item=4.0)

    def fixed(self, d: int) -> Work:
        """:meth:`NormalEquations.of`, once per problem: in sample space ``(alpha gamma L) G``
        (``2 nnz n`` flops, ``nnz`` rows of ``G`` read, ``n^2`` written); in feature space
        ``L X`` (``2 nnz d``), ``gemm(d, d, n)`` for ``X'(LX)`` and its symmetrisation (2
        flops, 5 passes of ``d^2``)."""
        n, nnz = self.n, self.nnz
        if self.n_space(d):
            return Work(2.0 * nnz * n, 8.0 * (nnz * n + n * n))
        lx = Work(2.0 * nnz * d, 8.0 * (nnz * d + n * d))
        return lx + gemm(d, d, n) + elementwise(d * d, flops_per_item=2.0, passes=5.0)

    def construction(self) -> Work:
        """``Problem(...)``: both graphs and both modalities' fixed parts of Eq. 16 (the
        Laplacians are O(nnz))."""
        return self.graph(self.da) + self.graph(self.db) + self.fixed(self.da) + self.fixed(self.db)

    def projection(self, d: int) -> Work:
        """One modality's ``X U``: ``gemm(n, c, d)``. :class:`Problem` computes it once per
        new ``U`` (:meth:`Problem.projection`), so it is counted where ``U`` changes."""
        return gemm(self.n, self.groups, d)

    def projections(self) -> Work:
        """``X_a U_a`` and ``X_b U_b``."""
        return self.projection(self.da) + self.projection(self.db)

    def objective(self) -> Work:
        """:meth:`Problem.objective` with the projections kept: ``L_p Z_p`` for both
        (``2 nnz c`` each)."""
        sparse_z = Work(
            2.0 * self.nnz * self.groups, 8.0 * (self.nnz * self.groups + 2 * self.n * self.groups)
        )
        return sparse_z * 2

    def update_u(self, modality: str, factorise: bool = True) -> Work:
        """:meth:`Problem.update_u` for ``X`` (``n x d``), the other side's projection kept;
        ``factorise=False`` for a solve with the weights of the last one (the factorisation
        kept, :meth:`NormalEquations.solve`).

        Sample space (``d > n``): ``K = w G + alpha gamma L G`` (2 flops, 5 passes of
        ``n^2``), its LU in place (:func:`lu_work`), the two triangular solves
        (:func:`substitution_work`) and ``U = X'T`` (``gemm(d, c, n)``). Feature space:
        ``sqrt(w) X`` (``n d``), its ``syrk`` (:func:`syrk`), the fixed part added (1 flop,
        3 passes of ``d^2``), the Cholesky (``d^3 / 3``, on a copy: one more pass of ``d^2``
        read and written), ``X'R`` (``gemm(d, c, n)``) and the triangular solves."""
        d = self.da if modality == "image" else self.db
        n, c = self.n, self.groups
        if self.n_space(d):
            factor = elementwise(n * n, flops_per_item=2.0, passes=5.0) + lu_work(n)
            return (factor if factorise else Work()) + substitution_work(n, c) + gemm(d, c, n)
        factor = (
            elementwise(n * d)
            + syrk(d, n)
            + elementwise(d * d, flops_per_item=1.0, passes=3.0)
            + elementwise(d * d, flops_per_item=0.0)
            + cholesky(d)
        )
        return (factor if factorise else Work()) + gemm(d, c, n) + substitution_work(d, c)

    def update_y(self, sweeps: int) -> Work:
        """:meth:`Problem.update_y` (the projections kept): per pair and sweep two ``c x c``
        products with the group sums (``sweeps``: the most it runs; it stops after a sweep
        that moves no pair)."""
        return matvec(self.groups, self.groups) * (2 * self.n * sweeps)

    def start(self, unplaced: int, regroup_steps: int = 0) -> Work:
        """:meth:`Problem.start`, warm (the k-means of a cold start is not counted): the
        ``unplaced`` pairs' nearest text centroids (the members' rows copied and averaged, 3
        passes of ``n d_t``; per group the unplaced rows copied, subtracted, squared and summed,
        3 flops and 8 passes of ``unplaced d_t``), ``regroup_steps`` Lloyd steps (the
        centres' initial means, then per step the distances, ``gemm(n, c, d_t)`` and 3 passes
        of ``n c``, and the members' means, 3 passes of ``n d_t``), two rounds of ``U_a``,
        ``U_b`` (the weights do not change between them: the second round only substitutes),
        and the projections
        each needs: ``X_b U_b`` three times (for the two ``U_a`` and the losses,
        the first with ``U_b = 0``), ``X_a U_a`` twice (for the two ``U_b``)."""
        dt = self.db - 1
        centroids = (
            elementwise(self.n * dt, passes=3.0)
            + elementwise(unplaced * dt, flops_per_item=3.0, passes=8.0) * self.groups
        )
        if regroup_steps:
            step = gemm(self.n, self.groups, dt) + elementwise(self.n * self.groups, passes=3.0)
            step = step + elementwise(self.n * dt, passes=3.0)
            centroids = centroids + elementwise(self.n * dt, passes=3.0) + step * regroup_steps
        rounds = (
            self.update_u("image")
            + self.update_u("text")
            + self.update_u("image", factorise=False)
            + self.update_u("text", factorise=False)
        )
        return centroids + rounds + self.projection(self.da) * 2 + self.projection(self.db) * 3

    def iterate(self, sweeps: int = 2) -> Work:
        """:meth:`Problem.iterate`: ``U_a``, ``U_b`` and their new projections, ``Y``, and the
        objective four times (the trace); ``v`` reuses the projections of the previous step,
        and the empty-group guard is not counted (it runs only when a group empties)."""
        return (
            self.update_u("image")
            + self.update_u("text")
            + self.projections()
            + self.update_y(sweeps)
            + self.objective() * 4
        )


def lu_work(m: int) -> Work:
    """``dgetrf`` of an ``m x m`` matrix in place: ``2 m^3 / 3`` flops, the matrix read and
    written once."""
    return Work(2.0 * m**3 / 3.0, 16.0 * m * m)


def substitution_work(m: int, c: int) -> Work:
    """The two triangular solves with an ``m x m`` factorisation for ``c`` columns:
    ``2 m^2 c`` flops, the factors read, the right-hand side read and the solution written."""
    return Work(2.0 * m * m * c, 8.0 * (m * m + 2.0 * m * c))
