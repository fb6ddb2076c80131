"""streamxm: learn image-text similarity from a live stream and serve it.

``from streamxm import Learner`` gives one model in your own process
(:class:`streamxm.learning.estimator.Learner`); the service parts live in the subpackages
(``docs/design.md``, README "Architecture").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LearnReport", "Learner", "SearchHit", "__version__"]

if TYPE_CHECKING:
    from streamxm.learning.estimator import Learner, LearnReport, SearchHit


def __getattr__(name: str) -> Any:
    # Imported on first use: the CLI and the service processes need not load the models.
    if name in ("LearnReport", "Learner", "SearchHit"):
        from streamxm.learning import estimator

        return getattr(estimator, name)
    raise AttributeError(f"module 'streamxm' has no attribute {name!r}")
