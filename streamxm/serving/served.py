"""What serving hands out: a served model version, an ensemble of served members, the gallery
index a version embedded, a search's answer, and the errors a query can meet.

All of them are immutable: a query takes one reference and sees one version, never half of a
swap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from streamxm.models import CrossModalModel
from streamxm.models.ensemble import Ensemble, EnsembleSpec
from streamxm.serving.gallery import Gallery, GalleryChunk
from streamxm.serving.index import Block, index_block

__all__ = ["AUTO", "EmbeddedGallery", "EnsembleUnsupported", "InvalidModelName", "ModelNotReady",
           "SameModalityUnsupported", "SearchAnswer", "ServedEnsemble", "ServedModel",
           "UnknownModel", "direction_of", "other_modality"]


class InvalidModelName(ValueError):
    """A name that is no model at all (not merely one without a learner here)."""


class UnknownModel(LookupError):
    """No learner of this model exists in the namespace."""


class ModelNotReady(LookupError):
    """The model exists (or the server has not looked yet) but no checkpoint is loaded."""


#: The model name that answers with the champion of the query's direction.
AUTO = "auto"


def direction_of(modality: str) -> str:
    """The retrieval direction of a query: ``"i2t"`` for image queries, ``"t2i"`` for text."""
    return "i2t" if modality == "image" else "t2i"


def other_modality(modality: str) -> Literal["image", "text"]:
    """``"image"`` <-> ``"text"``: the default search target of a query."""
    return "text" if modality == "image" else "image"


class SameModalityUnsupported(ValueError):
    """A same-modality search on a model without a shared embedding space."""


class EnsembleUnsupported(ValueError):
    """A query option an ensemble does not take (``field`` names it)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, eq=False)
class EmbeddedGallery:
    """The gallery embedded by one model version: the search index of the models without a
    fixed space (candidates from it are re-ranked exactly by the newest version)."""

    version: int
    model: CrossModalModel
    # chunk -> (image embeddings, text embeddings) as the backend scans them, in gallery order
    embedded: tuple[tuple[GalleryChunk, Block, Block], ...]
    #: The gallery snapshot of exactly these chunks (what the index's rows refer to).
    gallery: Gallery = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_blocks", {
            "image": tuple(a for _, a, _ in self.embedded),
            "text": tuple(b for _, _, b in self.embedded)})
        object.__setattr__(self, "gallery", Gallery(tuple(c for c, _, _ in self.embedded)))

    def blocks(self, modality: str) -> tuple[Block, ...]:
        return self._blocks[modality]  # type: ignore[attr-defined,no-any-return]

    def covers(self, gallery: Gallery) -> bool:
        """Whether this index is over exactly ``gallery``'s chunks (nothing to embed)."""
        return len(self.embedded) == len(gallery.chunks) and all(
            c is e[0] for c, e in zip(gallery.chunks, self.embedded, strict=True))

    def covering(self, gallery: Gallery) -> EmbeddedGallery:
        """The same version over ``gallery``: chunks it has keep their embeddings, new ones
        are embedded now (O(new rows))."""
        if self.covers(gallery):
            return self  # the common case on the query path: nothing to build
        known = {id(c): (c, a, b) for c, a, b in self.embedded}
        return EmbeddedGallery(self.version, self.model, tuple(
            known.get(id(c)) or _embed(self.model, c) for c in gallery.chunks))

    @classmethod
    def build(cls, version: int, model: CrossModalModel, gallery: Gallery) -> EmbeddedGallery:
        return cls(version, model, tuple(_embed(model, c) for c in gallery.chunks))


def _embed(model: CrossModalModel, chunk: GalleryChunk) -> tuple[GalleryChunk, Block, Block]:
    return (chunk, index_block(model.embed_images(chunk.raw("image")).astype(np.float32)),
            index_block(model.embed_texts(chunk.raw("text")).astype(np.float32)))


@dataclass(frozen=True, eq=False)
class ServedModel:
    """One model version; for a model without a fixed space also the newest gallery index
    embedded by some version (possibly older: it only proposes candidates)."""

    name: str
    version: int
    model: CrossModalModel
    head: dict[str, Any]
    loaded_at: float
    index: EmbeddedGallery | None = None
    gallery_items: int = 0

    @property
    def gallery_size(self) -> int:
        return self.gallery_items

    @property
    def versions(self) -> dict[str, int]:
        return {self.name: self.version}


@dataclass(frozen=True, eq=False)
class ServedEnsemble:
    """An ensemble (:mod:`streamxm.models.ensemble`) of the served version of each member: it
    has no version of its own (``version`` is None; ``versions`` has the members')."""

    spec: EnsembleSpec
    members: tuple[ServedModel, ...]
    version: None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def versions(self) -> dict[str, int]:
        return {m.name: m.version for m in self.members}

    @property
    def fused(self) -> Ensemble:
        return Ensemble(self.spec, {m.name: m.model for m in self.members})


@dataclass(frozen=True)
class SearchAnswer:
    """What :meth:`~streamxm.serving.server.ModelServer.search` found: hits best first, and
    how fresh the answer is."""

    served: ServedModel | ServedEnsemble
    hits: list[tuple[str, float]]
    #: Seconds since a newer checkpoint than the served one was written (0 when none is; an
    #: ensemble's: its most lagging member's).
    version_lag_s: float
    #: Version whose gallery index proposed the candidates (the served one on a fixed space;
    #: None for an ensemble, whose members each propose theirs).
    index_version: int | None
