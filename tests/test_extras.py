"""Optional dependencies: PyTorch and matplotlib are extras, and their absence says which to
install."""

from __future__ import annotations

import pytest

from streamxm.config import Settings


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


def test_the_default_gallery_backend_never_imports_ray(settings: Settings) -> None:
    """The ``local`` backend (the default) starts and serves without Ray: the app and a worker
    import nothing of it."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from api.app import create_app\n"
        "from streamxm.config import Settings\n"
        "from streamxm.service import build_worker\n"
        "from streamxm.serving.server import ModelServer\n"
        f"create_app(Settings.model_validate_json({settings.model_dump_json()!r}))\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_ray_backend_without_ray_says_which_extra_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    from streamxm.ray_gallery import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(RuntimeError, match=r"pip install 'streamxm\[ray\]'"):
        import_ray()
