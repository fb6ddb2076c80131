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
from streamxm.learning.stream_learner import StreamLearner
from streamxm.models import MODEL_NAMES
from streamxm.service import open_store
from streamxm.storage.checkpoint import Checkpoint
from streamxm.stream.keys import Keys
from streamxm.stream.messages import Pair
from streamxm.stream.producer import StreamProducer
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
    r: redis.Redis, settings: Settings
) -> None:
    pairs = _gallery()
    StreamProducer(r, settings.namespace).push_pairs(pairs)
    _serve_every_model(settings, r, pairs)
    ids = np.array([p.id for p in pairs])
    vectors = {"image": [p.img.tolist() for p in pairs], "text": [p.txt.tolist() for p in pairs]}
    with ApiServer(settings) as api, httpx.Client(base_url=api.url, timeout=60) as http:

        def all_loaded() -> bool:
            models = http.get("/v1/models").json()["models"]
            return len(models) == len(MODEL_NAMES) and all(
                m["loaded"] and m["gallery_items"] == len(pairs) for m in models
            )

        wait_for(all_loaded, 60, "every model and the whole gallery to load")
        for name in MODEL_NAMES:
            for modality, target, query in (
                ("image", "text", pairs[5].img),
                ("text", "image", pairs[5].txt),
                ("image", "text", pairs[77].img),
                ("text", "image", pairs[150].txt),
            ):
                found = http.post(
                    "/v1/search",
                    json={
                        "model": name,
                        "modality": modality,
                        "target": target,
                        "k": K,
                        "vector": query.tolist(),
                    },
                ).json()
                body = (
                    {"images": [query.tolist()], "texts": vectors["text"]}
                    if modality == "image"
                    else {"images": vectors["image"], "texts": [query.tolist()]}
                )
                scored = http.post(
                    "/v1/similarity", json={"model": name, "mode": "matrix", **body}
                ).json()
                assert scored["version"] == found["version"] == 1
                scores = np.asarray(scored["scores"], dtype=np.float64)
                scores = scores[0] if modality == "image" else scores[:, 0]
                best = np.argsort(-scores, kind="stable")[:K]
                got_ids = [hit["id"] for hit in found["results"]]
                got_scores = np.array([hit["score"] for hit in found["results"]])
                context = f"{name} {modality}->{target}"
                assert got_ids == ids[best].tolist(), context
                np.testing.assert_allclose(
                    got_scores, scores[best], rtol=1e-5, atol=1e-6, err_msg=context
                )
                assert found["version_lag_s"] == 0.0
                # The twins score alike wherever they rank: listed in gallery order.
                twins = [i for i in got_ids if i.startswith("twin")]
                assert twins == sorted(twins), context


ENSEMBLE = "ensemble:sdsrl+pairwise:marginal+sam"


def _exact_ranking(
    models: dict[str, object], name: str, modality: str, query: np.ndarray, gallery: list[Pair]
) -> tuple[list[str], np.ndarray]:
    """The exact top K of ``gallery`` for ``query`` by the local models (ties: gallery
    order), and their scores."""
    from streamxm.models.ensemble import Ensemble, member_scores, parse_ensemble

    items = np.stack([p.txt if modality == "image" else p.img for p in gallery])
    direction = "i2t" if modality == "image" else "t2i"
    if name.startswith("ensemble:"):
        fused = Ensemble(parse_ensemble(name), models)  # type: ignore[arg-type]
        scores = fused.scores(direction, query[None, :], items, reference=items)[0]
    else:
        scores = member_scores(models[name], direction, query[None, :], items)[0]  # type: ignore[arg-type]
    best = np.argsort(-scores, kind="stable")[:K]
    return [gallery[i].id for i in best], scores[best]


def test_every_version_answers_with_its_own_exact_ranking_as_the_gallery_grows(
    r: redis.Redis, settings: Settings
) -> None:
    """Three versions of every model, the gallery growing between them: each answer names the
    version that ranked it and equals that version's exact ranking of the gallery it served
    (the ensemble: its members' versions, fused exactly). One candidate asked for: 4 k = 40
    re-ranked of 120-240 items, so an index of another version would show."""
    settings = settings.model_copy(update={"search_candidates": 1})
    pairs = class_stream(240, IMG, TXT, seed=11)
    store = open_store(settings, r)
    learners = {
        name: StreamLearner(name, IMG, TXT, SMALL.get(name.split(":")[0], {}), seed=0)
        for name in MODEL_NAMES
    }
    client = StreamProducer(r, settings.namespace)
    with ApiServer(settings) as api, httpx.Client(base_url=api.url, timeout=60) as http:
        for version, upto in ((1, 120), (2, 180), (3, 240)):
            client.push_pairs(pairs[upto - 60 if version > 1 else 0 : upto])
            models = {}
            for name, learner in learners.items():
                learner.learn(pairs[upto - 60 if version > 1 else 0 : upto])
                learner.flush()
                arrays, meta = learner.state()
                store.commit(name, Checkpoint(version, arrays, meta), {})
                r.sadd(Keys(settings.namespace).models, name)
                models[name] = StreamLearner.from_state(arrays, meta).model

            def serving(v: int = version, n: int = upto) -> bool:
                listed = http.get("/v1/models").json()["models"]
                return len(listed) == len(MODEL_NAMES) and all(
                    m["loaded"]
                    and m["version"] == m["index_version"] == v
                    and m["gallery_items"] == n
                    for m in listed
                )

            # sam and cmomks serve a version before their index (the index thread catches up)
            wait_for(serving, 60, f"version {version} of every model, indexed, over {upto} items")
            gallery = pairs[:upto]
            for name in [*MODEL_NAMES, ENSEMBLE]:
                for modality, query in (
                    ("image", pairs[3].img),
                    ("text", pairs[upto - 7].txt),
                    ("image", pairs[upto - 30].img),
                ):
                    found = http.post(
                        "/v1/search",
                        json={
                            "model": name,
                            "modality": modality,
                            "k": K,
                            "vector": query.tolist(),
                        },
                    ).json()
                    context = f"{name} version {version} {modality} query"
                    named = found["members"] or {name: found["version"]}
                    assert set(named.values()) == {version}, (context, found)
                    assert found["index_version"] in (None, version), (context, found)
                    want_ids, want_scores = _exact_ranking(models, name, modality, query, gallery)
                    assert [h["id"] for h in found["results"]] == want_ids, context
                    np.testing.assert_allclose(
                        [h["score"] for h in found["results"]],
                        want_scores,
                        rtol=1e-5,
                        atol=1e-6,
                        err_msg=context,
                    )
        metrics = http.get("/metrics").text
        assert "streamxm_search_expansions_total" in metrics
        embedded = {
            line.split('"')[1]: float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith("streamxm_version_embedding_seconds{")
        }
        assert embedded["cmos"] == 0.0 and embedded["sdsrl"] > 0.0, embedded
