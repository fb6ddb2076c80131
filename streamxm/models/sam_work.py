"""The work SAM counts (:mod:`streamxm.models.work`): its inputs prepared, one step on a
mini-batch and an embedding, float32 throughout, at a model's settings."""

from __future__ import annotations

from typing import TYPE_CHECKING

from streamxm.models.optim import nesterov_work
from streamxm.models.sam_average import average_work
from streamxm.models.sam_inputs import EMBED_ROWS
from streamxm.models.sam_step import uses_compiled_descent
from streamxm.models.sam_tower import tower_forward_work, tower_training_work
from streamxm.models.work import Work, elementwise, gemm

if TYPE_CHECKING:
    from streamxm.models.sam import SAM

__all__ = ["distance_work", "embedding_work", "prepare_work", "step_work"]

_NET = 4  # itemsize of the towers, their inputs, margins and optimiser state: float32
#: Float32 passes over a (b, b) matrix: the margins (Eq. 6-10), the two hinges (Eq. 5), their
#: backward, the negatives and the statistics of :func:`~streamxm.models.sam_step.record`
#: (an estimate of ~100 elementwise torch ops, each reading or writing one (b, b) array).
_PAIRWISE_PASSES, _PAIRWISE_FLOPS = 100.0, 40.0
#: Float32 passes over the (b, classes) category matrix: its zero fill, four row or column sums
#: and the per-item normalisation (read and written).
_CATEGORY_PASSES = 7.0


def prepare_work(rows: int, dim: int, power: float | None) -> Work:
    """Inputs before a tower (:func:`~streamxm.models.sam_inputs.prepare_rows`), float32: when
    ``power`` is set, the absolute value (8 B per item), its power (8; none at ``power = 1``),
    the sign (8) and the product (12), the row norms (4) and the division (8); then the
    standardisation, subtract (12) and divide (8)."""
    n = float(rows) * dim
    prepare = Work(2.0 * n, 20.0 * n, 2.0 * n)
    if power is None:
        return prepare
    mapped = 5.0 * n if power != 1.0 else 4.0 * n
    return prepare + Work(mapped, (48.0 if power != 1.0 else 40.0) * n, mapped)


def distance_work(rows: int, dim: int) -> Work:
    """:func:`~streamxm.models.sam_inputs.pairwise_distances` of ``r`` rows: the ``r x r x d``
    product and five passes over the ``r x r`` result (scale, two norm additions, clip, square
    root, each read and written)."""
    return gemm(rows, rows, dim, _NET) + elementwise(
        rows * rows, _NET, flops_per_item=5.0, passes=10.0
    )


def step_work(model: SAM) -> Work:
    """One :meth:`~streamxm.models.sam.SAM.step` of ``model`` on ``b = batch_size`` rows (the
    reservoir holds ``replay >= b`` pairs in the steady state, so every step has ``b`` rows:
    ``b / step_every`` rows of gradient work per pair), float32 throughout, with ``h =
    hidden``, ``d = dim``, ``C`` the classes seen so far (at least one: the category matrix
    grows with them) and ``P`` parameters:

    - gathering: ``b`` rows of each modality from the reservoir and stacked (16 B per item);
    - both towers: inputs prepared (:func:`prepare_work`) and one forward and backward pass
      of ``b`` rows (:func:`~streamxm.models.sam_tower.tower_training_work`): ``2 b (d_in h +
      h d) + 2 b d_in h + 4 b h d`` flops per tower;
    - scores ``S = Z_v Z_t^T`` and its two backward products: ``3 x 2 b^2 d``; centroid
      cosines ``U U^T`` per modality: ``2 x 2 b^2 d``; input distances
      (:func:`distance_work`): ``2 b^2 (d_v + d_t)``; ``b x b`` elementwise passes;
    - categories: ``Y Y^T`` (``2 b^2 C``), the class sums ``Y^T Z`` per modality (``2 x 2 C b
      d``), the items' centroids ``Y_n Cent`` per modality (``2 x 2 b C d``), passes over
      ``Y`` (``b x C``);
    - Nesterov SGD, ``buf = mu buf + g``, ``w -= lr (g + mu buf)``: on the CPU one pass
      (:func:`~streamxm.models.optim.nesterov_work`: 5 flops and 20 B per parameter),
      elsewhere torch's single-tensor path (7 flops and 11 float32 passes, 44 B)
      (:func:`~streamxm.models.sam_step.descend`);
    - with ``ema``, the moving average's step (:func:`~streamxm.models.sam_average.average_work`:
      3 flops and 12 B per parameter).
    """
    b, h, d, c = model.batch_size, model.hidden, model.dim, max(1, len(model.classes))
    total = Work(0.0, 16.0 * b * (model.img_dim + model.txt_dim))
    params = 0
    for in_dim, power in ((model.img_dim, model.power_img), (model.txt_dim, model.power_txt)):
        total += (
            prepare_work(b, in_dim, power)
            + tower_training_work(b, in_dim, h, d)
            + distance_work(b, in_dim)
            + gemm(b, b, d, _NET)  # centroid cosines U U^T
            + gemm(c, d, b, _NET)  # class sums Y^T Z
            + gemm(b, d, c, _NET)
        )  # items' centroids Y_n Cent
        params += (in_dim + 1) * h + (h + 1) * d
    total += gemm(b, b, d, _NET) * 3.0  # S and its two backward products
    total += elementwise(b * b, _NET, _PAIRWISE_FLOPS, _PAIRWISE_PASSES)
    total += gemm(b, b, c, _NET)  # shared classes Y Y^T
    total += elementwise(b * c, _NET, flops_per_item=3.0, passes=_CATEGORY_PASSES)
    if model.average is not None:
        total += average_work(params)
    if uses_compiled_descent(model.device_, model.momentum):
        return total + nesterov_work(params)
    return total + elementwise(params, _NET, flops_per_item=7.0, passes=11.0)


def embedding_work(model: SAM, rows: int, modality: str) -> Work:
    """Embedding ``rows`` rows of ``modality`` (``"image"`` or ``"text"``) with ``model``, per
    chunk of ``r <= 4096`` rows (:data:`~streamxm.models.sam_inputs.EMBED_ROWS`; the weights are
    read once per chunk): the inputs prepared (:func:`prepare_work`) and the tower's inference
    pass (:func:`~streamxm.models.sam_tower.tower_forward_work`): ``2 r (d_in h + h d)``
    flops."""
    if modality == "image":
        in_dim, power = model.img_dim, model.power_img
    elif modality == "text":
        in_dim, power = model.txt_dim, model.power_txt
    else:
        raise ValueError(f"modality must be 'image' or 'text', got {modality!r}")
    total = Work()
    full, rest = divmod(rows, EMBED_ROWS)
    for chunk, times in ((EMBED_ROWS, full), (rest, 1 if rest else 0)):
        if times:
            total += times * (
                prepare_work(chunk, in_dim, power)
                + tower_forward_work(chunk, in_dim, model.hidden, model.dim)
            )
    return total
