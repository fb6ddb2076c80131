"""Build ``streamxm/data/digits_dct_kl.npz``: a second two-view benchmark of another kind than
Wikipedia's histograms, from the handwritten digits bundled with scikit-learn.

Each 8x8 digit gives two views that share only what the digit is (and the strokes that cross
the middle): the "image" view is the 2-D DCT-II (orthonormal) of its top half, 32 signed
coefficients whose scales fall by orders of magnitude from the DC term; the "text" view is the
Karhunen-Loeve (PCA) projection of its bottom half onto 16 components fitted on the training
split, signed and of decreasing variance. Split: 1,500 training / 297 test pairs, stratified by
class, seed 0. Run: ``python scripts/build_digits_twoview.py`` (needs scikit-learn, in the dev
extra); the output is byte-stable for a given scikit-learn and numpy.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from scipy.fft import dctn
from sklearn.datasets import load_digits
from sklearn.decomposition import PCA
from sklearn.model_selection import train_test_split

OUT = Path(__file__).resolve().parents[1] / "streamxm" / "data" / "digits_dct_kl.npz"


def main() -> None:
    digits = load_digits()
    images = digits.images.astype(np.float64)  # (1797, 8, 8), values 0..16
    y = digits.target.astype(np.int64)
    rows = np.arange(len(y))
    train, test = train_test_split(rows, train_size=1500, stratify=y, random_state=0)
    top = np.stack([dctn(im[:4], norm="ortho").ravel() for im in images])  # (n, 32)
    bottom = images[:, 4:].reshape(len(y), -1)  # (n, 32)
    kl = PCA(n_components=16, random_state=0).fit(bottom[train])
    text = kl.transform(bottom)
    np.savez_compressed(
        OUT,
        img_train=top[train].astype(np.float32),
        txt_train=text[train].astype(np.float32),
        y_train=y[train],
        img_test=top[test].astype(np.float32),
        txt_test=text[test].astype(np.float32),
        y_test=y[test],
        class_names=np.array([str(d) for d in range(10)]),
    )
    print(OUT, top.shape, text.shape, len(train), len(test))


if __name__ == "__main__":
    main()
