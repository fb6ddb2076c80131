"""A model joins without touching serving: a minimal model, defined here in tens of lines and
registered, learns from a real stream through a real worker, checkpoints, is served by the real
app and answers ``/v1/search`` with the exact ranking of the version it names (real Redis, real
HTTP)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis
from numpy.typing import NDArray

from streamxm import models
from streamxm.config import Settings
from streamxm.learning.stream_learner import model_from_state
from streamxm.models import (
    CrossModalModel,
    Example,
    History,
    LearnStats,
    model_class,
    register_model,
    split_name,
    unregister_model,
)
from streamxm.models.ensemble import parse_ensemble
from streamxm.service import build_worker, open_store
from streamxm.stream.producer import StreamProducer
from tests.conftest import IMG, TXT, ApiServer, class_stream, wait_for


class PullTogether(CrossModalModel, name="pull-together"):
    """``s(x, y) = (A x) . (B y)``: each pair pulls its two embeddings together, one gradient
    step of ``-s(x, y)`` with rows kept at unit norm; a mistake is a stored text scoring above
    the pair's own."""

    def __init__(self, img_dim: int, txt_dim: int, dim: int = 8, lr: float = 0.05) -> None:
        super().__init__(img_dim, txt_dim)
        self.dim, self.lr = dim, lr
        rng = np.random.default_rng(0)
        self.a_ = rng.standard_normal((dim, img_dim)) / np.sqrt(img_dim)
        self.b_ = rng.standard_normal((dim, txt_dim)) / np.sqrt(txt_dim)

    def learn_one(
        self, pair: Example, history: History, rng: np.random.Generator, stats: LearnStats
    ) -> None:
        x, y = pair.img.astype(np.float64), pair.txt.astype(np.float64)
        other = history.txt[int(rng.integers(len(history)))].astype(np.float64)
        mine, theirs = (self.a_ @ x) @ (self.b_ @ y), (self.a_ @ x) @ (self.b_ @ other)
        stats.add("i2t", bool(theirs >= mine), 0.0, True)
        a, b = self.a_ @ x, self.b_ @ y
        self.a_ += self.lr * np.outer(b, x)
        self.b_ += self.lr * np.outer(a, y)
        self.a_ /= np.linalg.norm(self.a_, axis=1, keepdims=True)
        self.b_ /= np.linalg.norm(self.b_, axis=1, keepdims=True)

    def embed_images(self, x: NDArray[np.floating]) -> NDArray[np.float32]:
        return np.asarray(np.atleast_2d(x) @ self.a_.T, dtype=np.float32)

    def embed_texts(self, x: NDArray[np.floating]) -> NDArray[np.float32]:
        return np.asarray(np.atleast_2d(x) @ self.b_.T, dtype=np.float32)

    def state(self) -> tuple[dict[str, NDArray[Any]], dict[str, Any]]:
        return {"a": self.a_, "b": self.b_}, {}

    def load_state(self, arrays: dict[str, NDArray[Any]], meta: dict[str, Any]) -> None:
        self.a_, self.b_ = arrays["a"].copy(), arrays["b"].copy()


@pytest.fixture
def registered() -> Any:
    register_model(PullTogether)
    yield PullTogether
    unregister_model("pull-together")


def test_a_registered_model_learns_is_served_and_searched_exactly(
    registered: Any, r: redis.Redis, settings: Settings
) -> None:
    pairs = class_stream(300, IMG, TXT, seed=5)
    StreamProducer(r, settings.namespace).push_pairs(pairs)
    stop = threading.Event()
    worker = threading.Thread(
        target=build_worker(settings, r, "pull-together").run, args=(stop,), daemon=True
    )
    worker.start()
    try:
        with ApiServer(settings) as api, httpx.Client(base_url=api.url, timeout=60) as http:

            def served() -> dict[str, Any] | None:
                for m in http.get("/v1/models").json()["models"]:
                    learned = m["pairs_seen"] == m["gallery_items"] == 300 and m["last_entry_id"]
                    if m["name"] == "pull-together" and m["loaded"] and learned:
                        return m  # type: ignore[no-any-return]
                return None

            info = wait_for(served, 60, "the model to learn every pair and be served")
            assert sum(info["mistakes"].values()) > 0  # it counted its own mistakes
            found = http.post(
                "/v1/search",
                json={
                    "model": "pull-together",
                    "modality": "image",
                    "k": 10,
                    "vector": pairs[11].img.tolist(),
                },
            ).json()
    finally:
        stop.set()
        worker.join(timeout=30)
    ckpt = open_store(settings, r).load("pull-together", found["version"])
    assert ckpt is not None
    model = model_from_state(ckpt.arrays, ckpt.meta)  # the version the answer names
    assert isinstance(model, PullTogether)
    scores = model.similarity(pairs[11].img[None, :], np.stack([p.txt for p in pairs]))[0]
    best = np.argsort(-scores, kind="stable")[:10]
    assert [hit["id"] for hit in found["results"]] == [pairs[i].id for i in best]
    assert np.allclose([hit["score"] for hit in found["results"]], scores[best], atol=1e-4)


def test_names_are_checked_and_installed_packages_join_by_entry_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Taken(PullTogether, name="cmos"):
        pass

    class Bad(PullTogether, name="Has Spaces"):
        pass

    with pytest.raises(ValueError, match="taken by CMOS"):
        register_model(Taken)
    with pytest.raises(ValueError, match="a model's name"):
        register_model(Bad)
    with pytest.raises(ValueError, match="built-in"):
        unregister_model("cmos")
    # A package that declares a model in its metadata, found by name in a fresh lookup.
    (tmp_path / "plugged_pkg").mkdir()
    (tmp_path / "plugged_pkg" / "__init__.py").write_text(
        "from tests.test_model_joins import PullTogether\n\n"
        "class Plugged(PullTogether, name='plugged'):\n    pass\n"
    )
    info = tmp_path / "plugged_pkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: plugged-pkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[streamxm.models]\nplugged = plugged_pkg:Plugged\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    models._entry_points.cache_clear()
    (info / "entry_points.txt").write_text(
        "[streamxm.models]\nplugged = plugged_pkg:Plugged\nmisnamed = plugged_pkg:Plugged\n"
    )
    try:
        assert split_name("plugged") == ("plugged", None)
        assert model_class("plugged").__name__ == "Plugged"
        with pytest.raises(ValueError, match="not a model class named 'misnamed'"):
            split_name("misnamed")
        # A registered model is an ensemble member like any other.
        spec = parse_ensemble("ensemble:cmos+plugged*2")
        assert spec.members == ("cmos", "plugged") and spec.weights == (1.0, 2.0)
    finally:
        unregister_model("plugged")
        models._entry_points.cache_clear()
