"""``/v1/search`` ranks exactly as ``/v1/similarity`` of the same version scores, for every model.

The checkpoints are written through the real store (as a worker commits them) and served by the
real app over HTTP, so the test covers both search paths: the query moved into the fixed space
of the unit rows (cmos, pairwise, pairwise:bipartite) and the embedded index re-ranked by the
served version (every other model).
"""

from __future__ import annotations

import httpx
import numpy as np
import redis

from streamxm.config import Settings
from streamxm.learning.learner import StreamLearner
from streamxm.models import MODEL_NAMES
from streamxm.service import open_store
from streamxm.storage.checkpoint import Checkpoint
from streamxm.stream.client import StreamClient
from streamxm.stream.keys import Keys
from streamxm.stream.messages import Pair
from tests.conftest import IMG, TXT, ApiServer, class_stream, wait_for
from tests.test_model_contract import SMALL

K = 10


def _gallery() -> list[Pair]:
    pairs = class_stream(240, IMG, TXT, seed=3)
    # Three copies of one pair spread through the gallery: equal scores, listed in push order.
    twin = pairs[5]
    for at, name in ((40, "twin-a"), (120, "twin-b"), (200, "twin-c")):
        pairs[at] = Pair(name, twin.img, twin.txt, twin.labels)
    return pairs


def _serve_every_model(settings: Settings, r: redis.Redis, pairs: list[Pair]) -> None:
    store = open_store(settings, r)
    for name in MODEL_NAMES:
        learner = StreamLearner(name, IMG, TXT, SMALL.get(name.split(":")[0], {}), seed=0)
        learner.learn(pairs)
        learner.flush()
        arrays, meta = learner.state()
        store.commit(name, Checkpoint(1, arrays, meta), {})
        r.sadd(Keys(settings.namespace).models, name)


def test_search_returns_the_similarity_ranking_of_the_served_version(
        r: redis.Redis, settings: Settings) -> None:
    pairs = _gallery()
    StreamClient(r, settings.namespace).push_pairs(pairs)
    _serve_every_model(settings, r, pairs)
    ids = np.array([p.id for p in pairs])
    vectors = {"image": [p.img.tolist() for p in pairs], "text": [p.txt.tolist() for p in pairs]}
    with ApiServer(settings) as api, httpx.Client(base_url=api.url, timeout=60) as http:
        def all_loaded() -> bool:
            models = http.get("/v1/models").json()["models"]
            return len(models) == len(MODEL_NAMES) and all(
                m["loaded"] and m["gallery_items"] == len(pairs) for m in models)

        wait_for(all_loaded, 60, "every model and the whole gallery to load")
        for name in MODEL_NAMES:
            for modality, target, query in (("image", "text", pairs[5].img),
                                            ("text", "image", pairs[5].txt),
                                            ("image", "text", pairs[77].img),
                                            ("text", "image", pairs[150].txt)):
                found = http.post("/v1/search", json={
                    "model": name, "modality": modality, "target": target, "k": K,
                    "vector": query.tolist()}).json()
                body = ({"images": [query.tolist()], "texts": vectors["text"]}
                        if modality == "image" else
                        {"images": vectors["image"], "texts": [query.tolist()]})
                scored = http.post("/v1/similarity", json={"model": name, "mode": "matrix",
                                                           **body}).json()
                assert scored["version"] == found["version"] == 1
                scores = np.asarray(scored["scores"], dtype=np.float64)
                scores = scores[0] if modality == "image" else scores[:, 0]
                best = np.argsort(-scores, kind="stable")[:K]
                got_ids = [hit["id"] for hit in found["results"]]
                got_scores = np.array([hit["score"] for hit in found["results"]])
                context = f"{name} {modality}->{target}"
                assert got_ids == ids[best].tolist(), context
                np.testing.assert_allclose(got_scores, scores[best], rtol=1e-5, atol=1e-6,
                                           err_msg=context)
                assert found["version_lag_s"] == 0.0
                # The twins score alike wherever they rank: listed in gallery order.
                twins = [i for i in got_ids if i.startswith("twin")]
                assert twins == sorted(twins), context
