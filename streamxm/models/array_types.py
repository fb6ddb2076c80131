"""The array types the models' signatures share."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

__all__ = ["F32", "F64", "Vectors"]

F32 = NDArray[np.float32]
F64 = NDArray[np.float64]
#: Input vectors of any float width (float32 from the stream, float64 from a batch).
Vectors = NDArray[np.floating]
