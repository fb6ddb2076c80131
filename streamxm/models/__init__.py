"""Model registry: names used everywhere (CLI, API, metrics, checkpoints), per ``docs/design.md``.

SAM is imported when first built: it needs PyTorch, whose import costs every other process
(workers of other models, the CLI) over a second, and which is an extra (``streamxm[sam]``) so
that a service without SAM does not install a deep-learning stack; building SAM without it says
which extra to install.

A model of your own joins by its class (:func:`register_model`) in the process that learns or
serves it, or, for every process at once, as an entry point of the group ``streamxm.models``
in its package's metadata (``[project.entry-points."streamxm.models"] mine =
"mypkg.models:Mine"``), loaded the first time its name is asked for. Serving needs nothing
more: a model that embeds images and texts (``embed_images``, ``embed_texts``) is searched
exactly through its embeddings of the gallery.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import re
from typing import Any

from streamxm.models.base import DIRECTIONS, CrossModalModel, LearnStats
from streamxm.models.cca import CCA
from streamxm.models.cmomks import CMOMKS
from streamxm.models.cmos import CMOS
from streamxm.models.history import Example, History
from streamxm.models.marginal import MarginalMatching
from streamxm.models.pairwise import PairwiseLogistic
from streamxm.models.scsm import SCSM
from streamxm.models.sdsrl import SDSRL

__all__ = [
    "DIRECTIONS",
    "MODELS",
    "MODEL_NAMES",
    "CrossModalModel",
    "Example",
    "History",
    "LearnStats",
    "check_params",
    "create_model",
    "model_class",
    "register_model",
    "split_name",
    "unregister_model",
]

MODELS: dict[str, type[CrossModalModel]] = {
    m.name: m for m in (CMOS, CMOMKS, PairwiseLogistic, CCA, SDSRL, SCSM)
}

#: Models whose module is imported on first use: name -> (module, class).
LAZY_MODELS: dict[str, tuple[str, str]] = {"sam": ("streamxm.models.sam", "SAM")}
#: The package extra that installs what each lazy model imports.
LAZY_EXTRAS: dict[str, str] = {"sam": "sam"}

#: Variants implemented by a class of their own (the others go to the base class as ``variant``).
VARIANT_CLASSES: dict[str, type[CrossModalModel]] = {"pairwise:marginal": MarginalMatching}

#: Every name a user may give, variants included.
MODEL_NAMES = (
    "cmos",
    "cmomks",
    "pairwise",
    "pairwise:bipartite",
    "pairwise:marginal",
    "cca",
    "sdsrl",
    "scsm",
    "sam",
)


#: The ``:variant`` suffixes each model takes (``pairwise:logistic`` is plain ``pairwise``).
VARIANTS: dict[str, tuple[str, ...]] = {"pairwise": ("logistic", "bipartite", "marginal")}


#: The entry-point group through which installed packages add models.
ENTRY_POINT_GROUP = "streamxm.models"
#: What a registered model may be called: it names keys, metrics labels and checkpoints.
_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")


def register_model(cls: type[CrossModalModel]) -> type[CrossModalModel]:
    """Make ``cls`` known by its ``name`` (``class Mine(CrossModalModel, name="mine")``) to
    every part of this process: workers, the API, benchmarks. Returns ``cls`` (a decorator).
    A name already taken by another class is refused."""
    name = getattr(cls, "name", "")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"a model's name is 1-32 of a-z, 0-9, '_' and '-', starting with a "
            f"letter; {cls.__name__} has {name!r}"
        )
    if name in LAZY_MODELS or MODELS.get(name, cls) is not cls:
        taken = LAZY_MODELS[name][1] if name in LAZY_MODELS else MODELS[name].__name__
        raise ValueError(f"model name {name!r} is taken by {taken}")
    MODELS[name] = cls
    return cls


def unregister_model(name: str) -> None:
    """Forget a model :func:`register_model` added (the built-in ones stay)."""
    if name in MODEL_NAMES:
        raise ValueError(f"{name!r} is a built-in model")
    MODELS.pop(name, None)


@functools.cache
def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    """The installed ``streamxm.models`` entry points, read once (an unknown name in a request
    must not cost a scan of every installed package)."""
    return {e.name: e for e in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _from_entry_points(name: str) -> None:
    """Register the installed entry point called ``name``, if there is one."""
    entry = _entry_points().get(name)
    if entry is None:
        return
    try:
        cls = entry.load()
    except Exception as exc:  # a broken plugin: the name stays unknown, with the reason
        raise ValueError(
            f"model {name!r}: its entry point {entry.value} fails to load "
            f"({type(exc).__name__}: {exc})"
        ) from None
    if not (isinstance(cls, type) and issubclass(cls, CrossModalModel)) or cls.name != name:
        raise ValueError(
            f"model {name!r}: its entry point {entry.value} is not a model class named {name!r}"
        )
    register_model(cls)


def split_name(name: str) -> tuple[str, str | None]:
    """``"pairwise:bipartite"`` -> ``("pairwise", "bipartite")``; unknown names raise.

    >>> split_name("cmos:fast")
    Traceback (most recent call last):
    ...
    ValueError: unknown model 'cmos:fast'; known: cmos, cmomks, pairwise, pairwise:bipartite, \
pairwise:marginal, cca, sdsrl, scsm, sam
    """
    base, sep, variant = name.partition(":")
    if base not in MODELS and base not in LAZY_MODELS and _NAME.fullmatch(base):
        _from_entry_points(base)
    if (base not in MODELS and base not in LAZY_MODELS) or (
        sep and variant not in VARIANTS.get(base, ())
    ):
        known = [*MODEL_NAMES, *(m for m in MODELS if m not in MODEL_NAMES)]
        raise ValueError(f"unknown model {name!r}; known: {', '.join(known)}")
    return base, variant or None


def create_model(
    name: str, img_dim: int, txt_dim: int, params: dict[str, Any] | None = None
) -> CrossModalModel:
    """Build a model by its name (with an optional ``:variant``)."""
    _, variant = split_name(name)
    kwargs = dict(params or {})
    if variant is not None:
        kwargs["variant"] = variant
    return model_class(name)(img_dim, txt_dim, **kwargs)


def check_params(name: str, params: dict[str, Any] | None) -> None:
    """Refuse a model name or parameters before anything starts: the model is built once at
    two dimensions a side (its checks do not depend on the dimensions), so a ``--param`` out of
    range or unknown raises the same :class:`ValueError` the first pair would have."""
    try:
        create_model(name, 2, 2, params)
    except ImportError as exc:  # an extra that is not installed: the pip line that fixes it
        raise ValueError(str(exc)) from None
    except TypeError as exc:  # an unexpected keyword: say which parameters there are
        known = ", ".join(sorted(create_model(name, 2, 2).params()))
        raise ValueError(f"model {name!r}: {exc}; its parameters: {known}") from None


def model_class(name: str) -> type[CrossModalModel]:
    """The class that implements ``name`` (importing it if it is a lazy one)."""
    base, _ = split_name(name)
    if name in VARIANT_CLASSES:
        return VARIANT_CLASSES[name]
    if base in LAZY_MODELS:
        module, cls = LAZY_MODELS[base]
        try:
            imported = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            extra = LAZY_EXTRAS[base]
            raise ImportError(
                f"model {name!r} needs {exc.name}, which is not installed: "
                f"pip install 'streamxm[{extra}]'"
            ) from exc
        found: type[CrossModalModel] = getattr(imported, cls)
        return found
    return MODELS[base]
