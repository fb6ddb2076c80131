"""A model's array attributes in its checkpoint (and in the parts its ranks merge), by name.

A model names the attributes it keeps as they are in one table, with the dtype each is restored
as, so that :meth:`~streamxm.models.base.CrossModalModel.state` and
:meth:`~streamxm.models.base.CrossModalModel.load_state` cannot list them differently.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from streamxm.models.base import Arrays

__all__ = ["ArrayAttributes", "attribute_arrays", "restore_attribute_arrays"]

#: Attribute names, in the order a checkpoint keeps them, each with the dtype it is restored as.
ArrayAttributes = Mapping[str, type[np.generic]]


def attribute_arrays(model: object, attributes: ArrayAttributes) -> Arrays:
    """``model``'s arrays named in ``attributes``, by name and in their order, as they are."""
    return {name: getattr(model, name) for name in attributes}


def restore_attribute_arrays(model: object, arrays: Arrays, attributes: ArrayAttributes) -> None:
    """Set each attribute named in ``attributes`` to a copy of ``arrays[name]`` in its dtype:
    what :func:`attribute_arrays` kept, restored."""
    for name, dtype in attributes.items():
        setattr(model, name, np.array(arrays[name], dtype=dtype))
