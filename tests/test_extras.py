"""Optional dependencies: PyTorch and matplotlib are extras, and their absence says which to
install."""

from __future__ import annotations

import pytest


def test_a_model_whose_extra_is_missing_says_which_extra_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    from streamxm.models import create_model

    monkeypatch.setitem(sys.modules, "torch", None)  # as if PyTorch were not installed
    monkeypatch.delitem(sys.modules, "streamxm.models.sam", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'streamxm\[sam\]'"):
        create_model("sam", 4, 3)
    assert create_model("cmos", 4, 3).img_dim == 4  # the others need nothing more
