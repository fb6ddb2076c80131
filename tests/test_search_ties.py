"""Ties come out in gallery (push) order at every ``k``: a model that has learned nothing scores
every item 0, and ``k=5`` must list the first five that ``k=100`` lists (real Redis, real HTTP,
a checkpoint committed through the real store)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import redis

from streamxm.config import Settings
from streamxm.learning.stream_learner import StreamLearner
from streamxm.service import open_store
from streamxm.storage.checkpoint import Checkpoint
from streamxm.stream.keys import Keys
from streamxm.stream.producer import StreamProducer
from tests.conftest import IMG, TXT, ApiServer, class_stream, wait_for


@pytest.mark.parametrize("name", ["cmos", "sdsrl"])
def test_tied_scores_are_listed_in_gallery_order_at_every_k(
    r: redis.Redis, settings: Settings, name: str
) -> None:
    pairs = class_stream(300, IMG, TXT, seed=4)
    StreamProducer(r, settings.namespace).push_pairs(pairs)
    learner = StreamLearner(name, IMG, TXT, {}, seed=0)  # nothing learned: every score ties
    learner.flush()
    arrays, meta = learner.state()
    open_store(settings, r).commit(name, Checkpoint(1, arrays, meta), {})
    r.sadd(Keys(settings.namespace).models, name)
    ids = [p.id for p in pairs]
    with ApiServer(settings) as api, httpx.Client(base_url=api.url, timeout=60) as http:
        wait_for(
            lambda: any(
                m["loaded"] and m["gallery_items"] == len(pairs)
                for m in http.get("/v1/models").json()["models"]
            ),
            60,
            "the model",
        )
        for modality, vector in (("image", pairs[7].img), ("text", pairs[7].txt)):
            answers = {}
            for k in (1, 5, 17, 100, 300):
                found = http.post(
                    "/v1/search",
                    json={"model": name, "modality": modality, "k": k, "vector": vector.tolist()},
                ).json()
                answers[k] = [hit["id"] for hit in found["results"]]
                scores = {hit["score"] for hit in found["results"]}
                if len(scores) == 1:  # all tied: the first k of the gallery
                    assert answers[k] == ids[:k], (k, answers[k][:8])
            for k, got in answers.items():
                assert got == answers[300][:k], (modality, k)


def test_the_scan_keeps_the_first_of_tied_rows_across_chunks() -> None:
    from streamxm.serving.index import top_k

    rng = np.random.default_rng(0)
    rows = rng.standard_normal((20_000, 8)).astype(np.float32)
    rows[::3] = 0.0  # a third of the rows tie at 0 with any query, spread over every chunk
    query = -np.abs(rng.standard_normal((1, 8))).astype(np.float32)
    rows[1::3] = np.abs(rows[1::3])  # these score below 0
    scores = (query @ rows.T)[0]
    want = np.lexsort((np.arange(len(rows)), -scores))  # by score, ties by row
    for k in (1, 5, 100, 4000, 7000):
        _, found = top_k(query, [rows[:9000], rows[9000:]], k)
        assert found[0].tolist() == want[:k].tolist(), k
