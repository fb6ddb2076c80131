"""The bundled digits two-view set: what its README says it is, loaded without pickles, and
rebuilt byte for byte by its script where scikit-learn is the version it was built with."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from streamxm.tools.datasets import bundled_digits_path, load_dataset
from tests.conftest import ROOT

README = ROOT / "streamxm" / "data" / "README.md"


def test_the_digits_set_is_what_its_readme_says() -> None:
    ds = load_dataset("digits")
    assert ds.img_train.shape == (1500, 32) and ds.txt_train.shape == (1500, 16)
    assert ds.img_test.shape == (297, 32) and len(ds.y_test) == 297
    assert ds.img_train.min() < 0 and ds.txt_train.min() < 0  # signed, not histograms
    spread = ds.img_train.std(axis=0)
    assert spread.max() / spread.min() > 4  # coefficients of different scales
    counts = " ".join(str(c) for c in np.bincount(ds.y_train))
    text = README.read_text()
    assert f"train: {counts};" in text
    md5 = hashlib.md5(bundled_digits_path().read_bytes()).hexdigest()
    assert re.search(rf"digits_dct_kl.*?md5 `{md5}`", text, re.S), "README's md5"


def test_the_script_rebuilds_the_same_arrays(tmp_path: Path) -> None:
    import sklearn

    if sklearn.__version__ not in README.read_text():
        pytest.skip(f"built with another scikit-learn than {sklearn.__version__}")
    script = (ROOT / "scripts" / "build_digits_twoview.py").read_text()
    out = tmp_path / "digits.npz"
    code = script.replace("OUT = Path(__file__)", f"OUT = Path({str(out)!r}) or Path(__file__)")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120)
    with np.load(out) as built, np.load(bundled_digits_path()) as shipped:
        for name in shipped.files:
            assert np.array_equal(built[name], shipped[name]), name
