"""The public in-process API: one model learning in your own process, without Redis.

:class:`Learner` is shaped like river's estimators (``learn_one`` on one example at a time) and
scikit-learn's (``get_params``), and runs exactly the code the worker runs
(:class:`~streamxm.learning.stream_learner.StreamLearner`: replay buffer, triplet sampling, rolling
test-then-train mAP, drift). ``save`` writes the same checkpoint format the worker writes, so a
model learned here can be served, and a worker's checkpoint file can be loaded here.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from streamxm.learning.stream_learner import StreamLearner
from streamxm.models import DIRECTIONS, split_name
from streamxm.storage.checkpoint import Checkpoint, decode_blob, encode_blob
from streamxm.stream.messages import Pair, make_pair

__all__ = ["LearnReport", "Learner", "SearchHit"]


@dataclass(frozen=True)
class LearnReport:
    """What one ``learn_one``/``learn_many`` call did, per direction (``i2t``, ``t2i``).

    Models that defer work (CMOS merges its updates in blocks, SAM steps every few pairs)
    report triplets when they are solved, so one call may report those of earlier pairs."""

    pairs: int
    triplets: dict[str, int]
    mistakes: dict[str, int]
    loss: dict[str, float]


@dataclass(frozen=True)
class SearchHit:
    """One search result: the row of the gallery and its score."""

    index: int
    score: float


def _rows(x: ArrayLike, name: str) -> NDArray[np.float32]:
    arr = np.asarray(x, dtype=np.float32)
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2:
        raise ValueError(
            f"{name} must be a vector or a matrix of row vectors, got shape {arr.shape}"
        )
    return arr


class Learner:
    """One cross-modal model, learned from pairs one at a time and queried in between.

    Parameters
    ----------
    model
        Model name (``cmos``, ``cmomks``, ``sam``, ``scsm``, ``sdsrl``, ``pairwise``,
        ``pairwise:bipartite``, ``pairwise:marginal``, ``cca``).
    img_dim, txt_dim
        Input sizes.
    seed
        Seed of every random choice (triplet sampling, initialisation).
    buffer_capacity, buffer_memory
        Replay buffer of recent pairs, and the class-balanced memory of the whole history
        beside it, drawn from during bursts of few classes (``None``: the model's default,
        :class:`~streamxm.learning.stream_learner.StreamLearner`).
    **params
        The model's constructor parameters (its docstring lists them).

    Examples
    --------
    Three topics whose images and texts lean towards a centre of their own; learn, score,
    search, save and load:

    >>> import numpy as np
    >>> from streamxm import Learner
    >>> rng = np.random.default_rng(0)
    >>> img_centres, txt_centres = rng.random((3, 8)), rng.random((3, 4))
    >>> def pair(c):
    ...     return img_centres[c] + 0.3 * rng.random(8), txt_centres[c] + 0.3 * rng.random(4)
    >>> learner = Learner("cmos", img_dim=8, txt_dim=4, C=0.5)
    >>> for i in range(600):
    ...     img, txt = pair(i % 3)
    ...     report = learner.learn_one(img, txt, labels=[i % 3])
    >>> learner.pairs_seen, learner.get_params()["C"]
    (600, 0.5)
    >>> texts = np.stack([pair(c)[1] for c in (0, 1, 2)])
    >>> learner.similarity(pair(1)[0], texts).argmax()  # the text of the image's own topic
    np.int64(1)
    >>> [hit.index for hit in learner.search(pair(2)[0], texts, k=2)][0]
    2
    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "cmos.npz")
    >>> learner.save(path)
    >>> restored = Learner.load(path)
    >>> img = pair(0)[0]
    >>> bool(np.array_equal(restored.similarity(img, texts), learner.similarity(img, texts)))
    True
    >>> restored.learn_one(*pair(0), labels=[0]).pairs  # and it learns on from there
    1
    """

    def __init__(
        self,
        model: str,
        img_dim: int,
        txt_dim: int,
        *,
        seed: int = 0,
        buffer_capacity: int = 500,
        buffer_memory: int | None = None,
        **params: Any,
    ) -> None:
        try:
            split_name(model)
        except ValueError as exc:
            raise ValueError(f"model: {exc}") from None
        for name, value in (("img_dim", img_dim), ("txt_dim", txt_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self._learner = StreamLearner(
            model,
            img_dim,
            txt_dim,
            params or None,
            seed=seed,
            buffer_capacity=buffer_capacity,
            buffer_memory=buffer_memory,
        )

    @classmethod
    def _wrapping(cls, learner: StreamLearner) -> Learner:
        wrapped = cls.__new__(cls)
        wrapped._learner = learner
        return wrapped

    # -- what it is ------------------------------------------------------------------------------
    @property
    def model(self) -> str:
        return self._learner.model_name

    @property
    def img_dim(self) -> int:
        return self._learner.img_dim

    @property
    def txt_dim(self) -> int:
        return self._learner.txt_dim

    @property
    def pairs_seen(self) -> int:
        return self._learner.pairs_seen

    def get_params(self) -> dict[str, Any]:
        """The model's constructor parameters, every one of them (defaults included)."""
        return dict(self._learner.model.params())

    def rolling_map(self) -> dict[str, float | None]:
        """Test-then-train mAP of the last queries per direction (None before any)."""
        return self._learner.rolling_map()

    # -- learning --------------------------------------------------------------------------------
    def learn_one(
        self, img: ArrayLike, txt: ArrayLike, labels: Sequence[int] | None = None
    ) -> LearnReport:
        """Test-then-train on one pair (its image, its text, optional labels)."""
        return self._learn([make_pair(str(self.pairs_seen), img, txt, labels)])

    def learn_many(
        self, imgs: ArrayLike, txts: ArrayLike, labels: Sequence[Sequence[int] | None] | None = None
    ) -> LearnReport:
        """Learn rows in order, as that many ``learn_one`` calls would (the state afterwards
        does not depend on how a stream is cut into calls)."""
        a, b = _rows(imgs, "imgs"), _rows(txts, "txts")
        if len(a) != len(b):
            raise ValueError(f"imgs and txts must have as many rows, got {len(a)} and {len(b)}")
        if labels is not None and len(labels) != len(a):
            raise ValueError(f"labels must have one entry per row, got {len(labels)}")
        start = self.pairs_seen
        pairs = [
            make_pair(str(start + i), a[i], b[i], None if labels is None else labels[i])
            for i in range(len(a))
        ]
        return self._learn(pairs)

    def _learn(self, pairs: list[Pair]) -> LearnReport:
        for pair in pairs:
            if pair.img.shape[0] != self.img_dim or pair.txt.shape[0] != self.txt_dim:
                raise ValueError(
                    f"pair has {pair.img.shape[0]}/{pair.txt.shape[0]} values, the "
                    f"learner takes {self.img_dim}/{self.txt_dim}"
                )
        out = self._learner.learn(pairs)
        return LearnReport(
            pairs=out["pairs"],
            triplets=dict(out["triplets"]),
            mistakes=dict(out["mistakes"]),
            loss={d: float(out["loss"][d]) for d in DIRECTIONS},
        )

    # -- using it --------------------------------------------------------------------------------
    def embed_images(self, imgs: ArrayLike) -> NDArray[np.float32]:
        """Image rows in the model's space: their inner products with embedded texts are
        the similarity scores."""
        self._learner.flush()
        return self._learner.model.embed_images(_rows(imgs, "imgs"))

    def embed_texts(self, txts: ArrayLike) -> NDArray[np.float32]:
        """Text rows in the model's space (see :meth:`embed_images`)."""
        self._learner.flush()
        return self._learner.model.embed_texts(_rows(txts, "txts"))

    def similarity(self, imgs: ArrayLike, txts: ArrayLike) -> NDArray[np.float64]:
        """Scores of every image row against every text row, shape ``(n_imgs, n_txts)``."""
        self._learner.flush()
        return self._learner.model.similarity(_rows(imgs, "imgs"), _rows(txts, "txts"))

    def search(
        self,
        query: ArrayLike,
        gallery: ArrayLike,
        *,
        modality: Literal["image", "text"] = "image",
        k: int = 10,
    ) -> list[SearchHit]:
        """The ``k`` best rows of ``gallery`` (items of the other modality) for one ``query``
        of ``modality``, best first; ties keep gallery order."""
        if modality not in ("image", "text"):
            raise ValueError(f"modality must be 'image' or 'text', got {modality!r}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if modality == "image":
            scores = self.similarity(query, gallery)[0]
        else:
            scores = self.similarity(gallery, query)[:, 0]
        order = np.argsort(-scores, kind="stable")[:k]
        return [SearchHit(int(i), float(scores[i])) for i in order]

    # -- checkpoints -----------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the whole learner (model, buffer, RNG, statistics) to ``path`` in the worker's
        checkpoint format: arrays plus JSON in an ``.npz``, never a pickle. Atomic: a reader
        sees the old file or the new one."""
        arrays, meta = self._learner.state()
        blob = encode_blob(Checkpoint(self.pairs_seen, arrays, meta))
        target = Path(path)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Learner:
        """A learner from :meth:`save`, or from a worker's checkpoint file (the directory store's
        ``v<version>-<sha>.npz``); it continues exactly where the saved one stopped."""
        ckpt = decode_blob(Path(path).read_bytes())
        return cls._wrapping(StreamLearner.from_state(ckpt.arrays, ckpt.meta))
