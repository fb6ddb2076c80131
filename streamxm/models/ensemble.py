"""Fusion as a model: ``ensemble:<a>+<b>+...`` ranks by the members' per-query standardised
scores, summed.

Members are learned models served (or benchmarked) side by side; the ensemble learns nothing of
its own. For a query ``q`` of one modality and an item ``x`` of the other, each member ``m``'s
score is standardised against that member's scores of the same query over a *reference* set of
items of ``x``'s modality::

    fused(q, x) = sum_m  w_m * (s_m(q, x) - mean_r s_m(q, r)) / std_r s_m(q, r)

Per-query standardisation makes members with different score scales (a bilinear form, a cosine,
a class-probability product) commensurable, and drops what is constant per query, which never
affects a ranking. In ``streamxm bench quality`` the reference is the test gallery that is ranked
(exactly the z-score of each member's row of scores); the API uses a uniform sample of at most
:data:`REFERENCE_ITEMS` items of the served gallery, those of the smallest hash keys of their
ids (the same sample whether one process or many shards hold the gallery,
:mod:`streamxm.serving.sharding`; a sample of that size leaves the
fused mAP on the Wikipedia features practically where the whole gallery puts it,
``docs/benchmarks.md``). A member whose reference scores are all equal
contributes its unscaled deviations (std taken as 1).

Weights: equal unless written in the name (``ensemble:sdsrl*2+sam``). They are not learned
from the members' rolling mAP: on the Wikipedia stream the members' rolling figures differ by
less than each of them moves within a pass, so weights following them would be equal weights
plus noise; a user who knows better writes them.

The score depends on which side is the query, so an ensemble's similarity has a direction:
``i2t`` (the image is the query, the default) or ``t2i``.

>>> import numpy as np
>>> from streamxm.learning.stream_learner import StreamLearner
>>> from streamxm.learning.evaluation import label_relevance, mean_average_precision, split_of
>>> from streamxm.tools.datasets import synthetic_pairs
>>> pairs = synthetic_pairs(400, img_dim=16, txt_dim=12, n_classes=4, seed=0, spread=3.0)
>>> models = {}
>>> for name in ("cca", "pairwise:marginal"):
...     learner = StreamLearner(name, 16, 12, seed=0)
...     _ = learner.learn(pairs[:300])
...     learner.flush()
...     models[name] = learner.model
>>> fused = Ensemble(parse_ensemble("ensemble:cca+pairwise:marginal"), models)
>>> img, txt, y = split_of(pairs[300:])
>>> relevant = label_relevance(y, y)
>>> maps = {name: mean_average_precision(member_scores(m, "i2t", img, txt), relevant)
...         for name, m in models.items()}
>>> fused_map = mean_average_precision(fused.scores("i2t", img, txt, reference=txt), relevant)
>>> bool(fused_map > max(maps.values()))  # above each member here
True
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from streamxm.models import split_name
from streamxm.models.embedding import Scores

__all__ = [
    "ENSEMBLE_PREFIX",
    "REFERENCE_ITEMS",
    "Ensemble",
    "EnsembleSpec",
    "is_ensemble",
    "member_scores",
    "parse_ensemble",
]

ENSEMBLE_PREFIX = "ensemble:"
#: Items of the served gallery each query's member scores are standardised against.
REFERENCE_ITEMS = 256
_WEIGHT = re.compile(r"(?P<name>[a-z][a-z0-9_-]*(?::[a-z]+)?)(?:\*(?P<weight>\d+(?:\.\d+)?))?")


@dataclass(frozen=True)
class EnsembleSpec:
    """A parsed ensemble name: members in the order written, with their weights."""

    name: str
    members: tuple[str, ...]
    weights: tuple[float, ...]


def is_ensemble(name: str) -> bool:
    return name.startswith(ENSEMBLE_PREFIX)


def parse_ensemble(name: str) -> EnsembleSpec:
    """``"ensemble:sdsrl*2+sam"`` -> members ``("sdsrl", "sam")``, weights ``(2.0, 1.0)``.

    Members must be distinct learned models (no nested ensembles, no ``auto``), at least two;
    weights are positive decimals.

    >>> parse_ensemble("ensemble:sdsrl+pairwise:marginal*0.5")
    EnsembleSpec(name='ensemble:sdsrl+pairwise:marginal*0.5', members=('sdsrl', \
'pairwise:marginal'), weights=(1.0, 0.5))
    >>> parse_ensemble("ensemble:sam+sam")
    Traceback (most recent call last):
    ...
    ValueError: ensemble 'ensemble:sam+sam' names 'sam' twice
    """
    if not is_ensemble(name):
        raise ValueError(f"{name!r} is not an ensemble (ensemble:<model>+<model>...)")
    parts = name[len(ENSEMBLE_PREFIX) :].split("+")
    if len(parts) < 2:
        raise ValueError(f"ensemble {name!r} needs at least two members joined by '+'")
    members, weights = [], []
    for part in parts:
        match = _WEIGHT.fullmatch(part)
        if match is None:
            raise ValueError(
                f"ensemble {name!r}: member {part!r} is not <model> or <model>*<weight>"
            )
        member = match["name"]
        split_name(member)  # an unknown member raises, naming the known ones
        if member in members:
            raise ValueError(f"ensemble {name!r} names {member!r} twice")
        weight = float(match["weight"] or 1.0)
        if weight <= 0:
            raise ValueError(f"ensemble {name!r}: weight of {member!r} must be > 0")
        members.append(member)
        weights.append(weight)
    return EnsembleSpec(name, tuple(members), tuple(weights))


def member_scores(
    model: Scores,
    direction: str,
    queries: NDArray[np.floating],
    items: NDArray[np.floating],
    paired: bool = False,
) -> NDArray[np.float64]:
    """One model's scores: image queries against texts for ``i2t``, text queries against images
    for ``t2i``; (n_queries, n_items), or with ``paired`` query ``i`` against item ``i`` only."""
    if direction not in ("i2t", "t2i"):
        raise ValueError(f"direction must be 'i2t' or 't2i', got {direction!r}")
    imgs, txts = (queries, items) if direction == "i2t" else (items, queries)
    if paired:
        a = model.embed_images(imgs).astype(np.float64)
        b = model.embed_texts(txts).astype(np.float64)
        return np.asarray(np.einsum("ij,ij->i", a, b), dtype=np.float64)
    scores = np.asarray(model.similarity(imgs, txts), dtype=np.float64)
    return scores if direction == "i2t" else scores.T


class Ensemble:
    """The members' per-query standardised scores, weighted and summed.

    Parameters
    ----------
    spec
        The parsed name (:func:`parse_ensemble`).
    models
        Every member's scores by name (a model, or one version's embedding kind).
    """

    def __init__(self, spec: EnsembleSpec, models: Mapping[str, Scores]) -> None:
        self.spec = spec
        self.models = {m: models[m] for m in spec.members}

    def scores(
        self,
        direction: str,
        queries: NDArray[np.floating],
        items: NDArray[np.floating],
        reference: NDArray[np.floating],
        paired: bool = False,
    ) -> NDArray[np.float64]:
        """Fused scores (n_queries, n_items), or with ``paired`` of query ``i`` and item ``i``
        (n,); each member standardised per query over its scores of ``reference`` (items of
        the same modality as ``items``, at least two)."""
        fused = np.zeros(len(queries) if paired else (len(queries), len(items)))
        standards = self.standardisers(direction, queries, reference)
        for member, (mean, std) in zip(self.spec.members, standards, strict=True):
            if not paired:
                mean, std = mean[:, None], std[:, None]
            scores = member_scores(self.models[member], direction, queries, items, paired)
            fused += (scores - mean) / std
        return fused

    def standardisers(
        self, direction: str, queries: NDArray[np.floating], reference: NDArray[np.floating]
    ) -> list[tuple[NDArray[np.float64], NDArray[np.float64]]]:
        """Per member, in order, the ``(offset, scale)`` per query that :meth:`scores` maps its
        scores with, ``fused = sum_m (s_m - offset_m) / scale_m``: the reference mean and the
        reference standard deviation divided by the member's weight (std 1 when it is 0).
        Increasing in each member's score, so a bound on each member's scores bounds the
        fused score."""
        if len(reference) < 2:
            raise ValueError(
                "an ensemble needs at least two reference items to standardise its members' scores"
            )
        out = []
        for member, weight in zip(self.spec.members, self.spec.weights, strict=True):
            ref = member_scores(self.models[member], direction, queries, reference)
            mean, std = ref.mean(axis=1), ref.std(axis=1)
            std[std <= 0] = 1.0
            out.append((mean, std / weight))
        return out
