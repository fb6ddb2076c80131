"""MPL-CD: the coordinate descent of SDSRL for the projections ``A``, ``B`` (Jiang et al.,
Algorithm 1 and the Newton step of its appendix), on the low-rank form of the targets.

The targets are ``M_I = G G'``, ``M_T = H H'`` and ``M_C = G H'`` with ``G = (Phi'Phi + mu I)^-1
Phi'L`` and ``H`` likewise for texts (``S = L L'`` counts shared labels), so every quantity the
descent needs reduces to ``q x q`` and ``c x q`` products: one coordinate step costs ``O(q + c)``
instead of the ``O(m)`` of the dense ``m x m`` matrices, and no ``m x m`` target is ever formed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from streamxm.models.array_types import F64
from streamxm.models.compiled import njit
from streamxm.models.work import Work, elementwise, gemm, syrk

__all__ = ["CDResult", "dense_targets", "mpl_cd", "mpl_cd_work", "projection_loss"]


def projection_loss(a: F64, b: F64, g: F64, h: F64) -> float:
    """``||GG' - AA'||^2 + ||HH' - BB'||^2 + ||GH' - AB'||^2`` from small products only.

    >>> rng = np.random.default_rng(0)
    >>> a, b, g, h = (rng.normal(size=s) for s in [(6, 2), (4, 2), (6, 3), (4, 3)])
    >>> mi, mt, mc = dense_targets(g, h)
    >>> dense = (np.sum((mi - a @ a.T) ** 2) + np.sum((mt - b @ b.T) ** 2)
    ...          + np.sum((mc - a @ b.T) ** 2))
    >>> bool(np.isclose(projection_loss(a, b, g, h), dense))
    True
    """
    ata, btb, gtg, hth = a.T @ a, b.T @ b, g.T @ g, h.T @ h
    gta, htb = g.T @ a, h.T @ b
    sym_a = np.sum(ata * ata) - 2 * np.sum(gta * gta) + np.sum(gtg * gtg)
    sym_b = np.sum(btb * btb) - 2 * np.sum(htb * htb) + np.sum(hth * hth)
    cross = np.sum(ata * btb) - 2 * np.sum(gta * htb) + np.sum(gtg * hth)
    return float(max(sym_a + sym_b + cross, 0.0))


def dense_targets(g: F64, h: F64) -> tuple[F64, F64, F64]:
    """``M_I, M_T, M_C`` as dense matrices (tests and small problems only)."""
    return g @ g.T, h @ h.T, g @ h.T


@njit()
def _quartic_change(d: float, grad: float, hess: float, aij: float) -> float:
    return d * (grad + d * (0.5 * hess + d * (4.0 * aij + d)))


@njit()
def _quartic_argmin(grad: float, hess: float, aij: float) -> float:
    """The step minimising the coordinate's quartic exactly: the best real root of its
    derivative ``4 d^3 + 12 A_ij d^2 + f2 d + f1`` (Cardano on the depressed cubic)."""
    p = hess / 4.0 - 3.0 * aij * aij
    q = 2.0 * aij**3 - aij * hess / 4.0 + grad / 4.0
    disc = (q / 2.0) ** 2 + (p / 3.0) ** 3
    if disc >= 0.0:
        s = math.sqrt(disc)
        return float(np.cbrt(-q / 2.0 + s) + np.cbrt(-q / 2.0 - s)) - aij
    radius = 2.0 * math.sqrt(-p / 3.0)
    angle = math.acos(max(-1.0, min(1.0, (3.0 * q / (2.0 * p)) * math.sqrt(-3.0 / p)))) / 3.0
    best, best_change = 0.0, math.inf
    for k in range(3):  # the first of equal changes, as min() picks
        d = radius * math.cos(angle - 2.0 * math.pi * k / 3.0) - aij
        change = _quartic_change(d, grad, hess, aij)
        if change < best_change:
            best, best_change = d, change
    return best


def _sweep(a: F64, g: F64, btb: F64, htb: F64, order: NDArray[np.intp]) -> None:
    """One pass of coordinate Newton steps over the entries of ``a`` (in ``order``), ``B`` fixed.

    The sub-problem is ``f(A) = ||AA' - GG'||^2 + ||AB' - GH'||^2``. Moving ``A_ij`` by ``d``
    changes ``f`` by the quartic ``f1 d + f2 d^2 / 2 + 4 A_ij d^3 + d^4`` with
    ``f1 = 4 (R A)_ij + 2 (K B)_ij`` and ``f2 = 4 (||A_:j||^2 + A_ij^2 + R_ii) + 2 (B'B)_jj``
    (``R = AA' - GG'``, ``K = AB' - GH'``), the first and second derivatives of the appendix.
    Where the coordinate is convex (``f2 > 0``) the step is Newton's ``-f1 / f2``, halved until
    the quartic says it lowers ``f`` (a Newton step on a quartic can overshoot). Where it is
    concave (``f2 <= 0``, as everywhere near ``A = 0``, where Newton would climb) the quartic is
    minimised exactly. The paper says neither; with both, every step lowers the loss or leaves it.
    The steps run compiled (:func:`_steps`): a step is ``O(q + c)`` work, far below what an
    interpreted loop costs per entry.
    """
    # p = 2 A'A + B'B and r = 2 G'A + H'B give the gradient in one dot product each.
    p = np.ascontiguousarray(2.0 * (a.T @ a) + btb)
    r = np.ascontiguousarray(2.0 * (g.T @ a) + htb)
    row_sq = np.einsum("ij,ij->i", a, a)
    g_sq = np.einsum("ij,ij->i", g, g)
    _steps(a, np.ascontiguousarray(g), p, r, row_sq, g_sq, np.asarray(order, dtype=np.int64))


@njit(boundscheck=False)
def _steps(
    a: F64, g: F64, p: F64, r: F64, row_sq: F64, g_sq: F64, order: NDArray[np.int64]
) -> None:  # pragma: no cover - compiled
    q, c = a.shape[1], g.shape[1]
    for flat in order:
        i, j = flat // q, flat % q
        aij = a[i, j]
        ap = 0.0
        for t in range(q):
            ap += a[i, t] * p[t, j]
        gr = 0.0
        for t in range(c):
            gr += g[i, t] * r[t, j]
        grad = 2.0 * (ap - gr)
        hess = 2.0 * p[j, j] + 4.0 * aij * aij + 4.0 * (row_sq[i] - g_sq[i])
        if hess <= 0.0:
            d = _quartic_argmin(grad, hess, aij)
            if _quartic_change(d, grad, hess, aij) >= 0.0:
                continue
        else:
            if grad == 0.0:
                continue
            d = -grad / hess
            lowered = False
            for _ in range(30):
                if _quartic_change(d, grad, hess, aij) < 0.0:
                    lowered = True
                    break
                d *= 0.5
            if not lowered:
                continue
        for t in range(q):
            p[j, t] += 2.0 * d * a[i, t]
        for t in range(q):
            p[t, j] += 2.0 * d * a[i, t]
        p[j, j] += 2.0 * d * d
        for t in range(c):
            r[t, j] += 2.0 * d * g[i, t]
        row_sq[i] += 2.0 * d * aij + d * d
        a[i, j] = aij + d


@dataclass
class CDResult:
    """Projections and how the descent went: the loss after each outer loop."""

    a: F64
    b: F64
    losses: list[float] = field(default_factory=list)
    converged: bool = False


def mpl_cd(
    g: F64,
    h: F64,
    a: F64,
    b: F64,
    rng: np.random.Generator,
    outer: int = 10,
    inner: int = 3,
    tol: float = 1e-5,
) -> CDResult:
    """Minimise :func:`projection_loss` over ``A`` (m1 x q) and ``B`` (m2 x q) from ``a``, ``b``.

    Each of ``outer`` loops solves the ``A`` sub-problem (``B`` fixed) by ``inner`` sweeps of
    coordinate steps in a fresh random order of the entries, then the ``B`` sub-problem; it stops
    early when the loss changes by less than ``tol`` relative to the loss before the loop (or
    reaches 0). Every step lowers the loss, so ``losses`` never increases.

    >>> rng = np.random.default_rng(0)
    >>> g, h = rng.normal(size=(8, 2)), rng.normal(size=(5, 2))
    >>> res = mpl_cd(g, h, 0.1 * rng.normal(size=(8, 2)), 0.1 * rng.normal(size=(5, 2)), rng,
    ...              outer=50)
    >>> bool(res.losses[-1] < 1e-6 * projection_loss(0 * res.a, 0 * res.b, g, h))
    True
    """
    a = np.array(a, dtype=np.float64)
    b = np.array(b, dtype=np.float64)
    g = np.asarray(g, dtype=np.float64)
    h = np.asarray(h, dtype=np.float64)
    result = CDResult(a, b, [projection_loss(a, b, g, h)])
    for _ in range(outer):
        for _ in range(inner):
            _sweep(a, g, b.T @ b, h.T @ b, rng.permutation(a.size))
        for _ in range(inner):
            _sweep(b, h, a.T @ a, g.T @ a, rng.permutation(b.size))
        before, after = result.losses[-1], projection_loss(a, b, g, h)
        result.losses.append(after)
        if after == 0.0 or before - after <= tol * before:
            result.converged = True
            break
    return result


# -- the work counted (streamxm/models/work.py) ------------------------------------------------
def projection_loss_work(m1: int, m2: int, classes: int, q: int) -> Work:
    """:func:`projection_loss` with ``A`` ``(m1, q)``, ``B`` ``(m2, q)`` and ``c`` class columns:
    ``A'A``, ``B'B`` (``q^2 m`` each, ``syrk``), ``G'G``, ``H'H`` (``c^2 m`` each, ``syrk``,
    recomputed at every call although ``G``, ``H`` do not change during a descent),
    ``G'A``, ``H'B`` (``2 c q m`` each), and nine products summed over ``q^2``, ``c q`` and
    ``c^2`` entries (2 flops, four passes an entry)."""
    c = classes
    return (
        syrk(q, m1)
        + syrk(q, m2)
        + syrk(c, m1)
        + syrk(c, m2)
        + gemm(c, q, m1)
        + gemm(c, q, m2)
        + elementwise(3 * (q * q + c * q + c * c), flops_per_item=2.0, passes=4.0)
    )


def sweep_work(n: int, classes: int, q: int) -> Work:
    """One :func:`_sweep` over the ``n q`` entries of an ``(n, q)`` side with ``c`` class
    columns, every step taken (an upper bound: a step that cannot lower the loss is skipped):

    - ``p = 2 A'A + B'B`` (``q^2 n``, ``syrk``), ``r = 2 G'A + H'B`` (``2 c q n``), the row
      norms of ``A`` and ``G`` (``2 n q + 2 n c``);
    - per entry, the gradient ``A_i. p_.j - G_i. r_.j`` (``2 q + 2 c``) and the updates of
      ``p``'s row and column and of ``r``'s column (``4 q + 2 c``): ``6 q + 4 c`` flops and
      ``8 (c + 2 q)`` bytes, the rows ``G_i.`` and ``A_i.`` read (``r`` and ``p``, ``c x q``
      and ``q x q``, stay in cache).
    """
    c = classes
    per_entry = Work(6.0 * q + 4.0 * c, 8.0 * (c + 2.0 * q))
    norms = elementwise(n * (q + c), flops_per_item=2.0, passes=1.0)
    return syrk(q, n) + gemm(c, q, n) + norms + per_entry * float(n * q)


def mpl_cd_work(m1: int, m2: int, classes: int, q: int, outer: int, inner: int) -> Work:
    """:func:`mpl_cd` run to its ``outer`` loops (an upper bound: it stops early when the loss
    settles): the copies of ``A``, ``B``, the first loss ``L`` and per loop ``inner`` sweeps of
    each side after its fixed side's products (``B'B``: ``q^2 m2``, ``H'B``: ``2 c q m2``;
    likewise for ``B``'s sweeps), then ``L``:

    ``L + outer (inner (S_A + S_B) + L)`` (:func:`projection_loss_work`, :func:`sweep_work`).
    """
    c = classes
    loss = projection_loss_work(m1, m2, c, q)
    sweeps_a = inner * (syrk(q, m2) + gemm(c, q, m2) + sweep_work(m1, c, q))
    sweeps_b = inner * (syrk(q, m1) + gemm(c, q, m1) + sweep_work(m2, c, q))
    copies = elementwise((m1 + m2) * q, flops_per_item=0.0)
    return copies + loss + outer * (sweeps_a + sweeps_b + loss)
