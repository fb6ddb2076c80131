"""Issue 21's fusion as a model: ``ensemble:<a>+<b>`` in ``bench quality``, ``/v1/similarity``
and ``/v1/search`` (candidates from every member, fused exactly over their union)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import redis

from streamxm.config import Settings
from streamxm.models.ensemble import REFERENCE_ITEMS, parse_ensemble
from streamxm.models.heads import RbfFeatures
from streamxm.service import build_worker, open_store
from streamxm.serving.gallery import reference_rows
from streamxm.serving.served import (
    EnsembleUnsupported,
    InvalidModelName,
    SameModalityUnsupported,
    UnknownModel,
)
from streamxm.serving.server import ModelServer
from streamxm.stream.producer import StreamProducer
from streamxm.tools.bench import quality
from tests.conftest import ApiServer, class_stream, metric, wait_for

ENSEMBLE = "ensemble:cmos+sdsrl"  # a fixed-space member and an embedded-index member


def _z(scores: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Each row of ``scores`` standardised by the same row of ``reference`` (the definition)."""
    return (scores - reference.mean(1, keepdims=True)) / reference.std(1, keepdims=True)


@pytest.fixture
def learned(r: redis.Redis, settings: Settings) -> tuple[Settings, list]:
    pairs = class_stream(300, 12, 6, seed=3)
    StreamProducer(r, settings.namespace).push_pairs(pairs)
    for model in ("cmos", "sdsrl"):
        build_worker(settings, r, model).run(until_idle=True)
    return settings, pairs


@pytest.mark.parametrize("compact", [False, True])
def test_ensemble_search_is_the_fused_ranking_of_the_gallery(
    r: redis.Redis, learned: tuple[Settings, list], compact: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also as a large gallery keeps sdsrl's kernel rows (float16): its member's index then
    only bounds its scores and the ensemble fuses member by member."""
    if compact:
        monkeypatch.setattr(RbfFeatures, "compact_from_rows", 1)
    settings, pairs = learned
    # Candidates >= gallery: the union of the members' candidates is the whole gallery, so the
    # answer must be the brute-force fused ranking, scored as /v1/similarity scores.
    server = ModelServer(r, open_store(settings, r), settings.namespace, candidates=400)
    server.refresh()
    cmos, sdsrl = server.get("cmos").model, server.get("sdsrl").model
    img = np.stack([p.img for p in pairs])
    txt = np.stack([p.txt for p in pairs])
    sample = reference_rows([p.id for p in pairs], REFERENCE_ITEMS)  # all 300 here
    for modality, vector, direction, items in (
        ("image", pairs[7].img, "i2t", txt),
        ("text", pairs[9].txt, "t2i", img),
    ):
        answer = server.search(ENSEMBLE, modality, vector.astype(np.float32), k=10)
        if direction == "i2t":
            raw = [m.similarity(vector[None, :], items) for m in (cmos, sdsrl)]
        else:
            raw = [m.similarity(items, vector[None, :]).T for m in (cmos, sdsrl)]
        want = sum(_z(s, s[:, sample]) for s in raw)[0]
        order = np.argsort(-want, kind="stable")[:10]
        assert [h[0] for h in answer.hits] == [pairs[i].id for i in order]
        np.testing.assert_allclose([h[1] for h in answer.hits], want[order], rtol=1e-6)
        assert answer.index_version is None and answer.served.version is None
        assert answer.served.versions == {
            "cmos": server.get("cmos").version,
            "sdsrl": server.get("sdsrl").version,
        }
        # The same scores from similarity in the same direction (the query on its side).
        query, found = vector[None, :].astype(np.float32), items[order].astype(np.float32)
        _, scores = (
            server.similarity(ENSEMBLE, query, found, True, direction="i2t")
            if direction == "i2t"
            else server.similarity(ENSEMBLE, found, query, True, direction="t2i")
        )
        np.testing.assert_allclose(np.ravel(scores), want[order], rtol=1e-6)
    # Paired scores are the matrix's diagonal.
    few_img, few_txt = img[:5].astype(np.float32), txt[:5].astype(np.float32)
    _, paired = server.similarity(ENSEMBLE, few_img, few_txt, False, direction="t2i")
    _, full = server.similarity(ENSEMBLE, few_img, few_txt, True, direction="t2i")
    np.testing.assert_allclose(paired, np.diag(full), rtol=1e-6)  # float32 embeddings


def test_sdsrl_from_float16_kernel_rows_answers_its_exact_ranking(
    r: redis.Redis, learned: tuple[Settings, list], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large gallery keeps sdsrl's kernel rows in float16: the index's scores then only
    bound the version's, so a search proves its few candidates complete by the kept rows'
    rounding bound and scores them from the raw vectors: the answer is the exact ranking,
    with the version's own scores."""
    monkeypatch.setattr(RbfFeatures, "compact_from_rows", 1)
    settings, pairs = learned
    server = ModelServer(r, open_store(settings, r), settings.namespace, candidates=1)
    server.refresh()
    served = server.get("sdsrl")
    index = server.index_of(served)
    assert not index.exact("image") and not index.exact("text")
    img = np.stack([p.img for p in pairs]).astype(np.float32)
    txt = np.stack([p.txt for p in pairs]).astype(np.float32)
    for j in range(0, 60, 6):
        for modality, vector, items in (("image", img[j], txt), ("text", txt[j], img)):
            answer = server.search("sdsrl", modality, vector, k=5)
            want = (
                served.model.similarity(vector[None, :], items)[0]
                if modality == "image"
                else served.model.similarity(items, vector[None, :])[:, 0]
            )
            order = np.argsort(-want.astype(np.float64), kind="stable")[:5]
            assert [h[0] for h in answer.hits] == [pairs[i].id for i in order]
            np.testing.assert_allclose([h[1] for h in answer.hits], want[order], rtol=1e-6)
    query = served.model.embed_images(img[:1])[0]
    assert index.scan_error("text", query) > 0  # the bound the candidates were proven by


def test_ensemble_refusals_name_what_is_wrong(
    r: redis.Redis, learned: tuple[Settings, list]
) -> None:
    settings, pairs = learned
    server = ModelServer(r, open_store(settings, r), settings.namespace)
    server.refresh()
    q = pairs[0].img.astype(np.float32)
    with pytest.raises(EnsembleUnsupported, match="no versions of its own"):
        server.search(ENSEMBLE, "image", q, 5, version=1)
    with pytest.raises(SameModalityUnsupported, match="cross-modal search only"):
        server.search(ENSEMBLE, "image", q, 5, target="image")
    with pytest.raises(InvalidModelName, match="unknown model 'nope'"):
        server.search("ensemble:cmos+nope", "image", q, 5)
    with pytest.raises(InvalidModelName, match="at least two"):
        server.search("ensemble:cmos", "image", q, 5)
    with pytest.raises(UnknownModel, match="'sam' has no learner"):
        server.search("ensemble:cmos+sam", "image", q, 5)
    assert parse_ensemble("ensemble:cmos*2+sdsrl").weights == (2.0, 1.0)


def test_ensemble_over_http(r: redis.Redis, learned: tuple[Settings, list]) -> None:
    settings, pairs = learned
    q = pairs[4]
    with ApiServer(settings) as api, httpx.Client(base_url=api.url, timeout=30) as http:
        wait_for(lambda: http.get("/readyz").status_code == 200, 30, "ready")
        wait_for(
            lambda: (
                {m["name"] for m in http.get("/v1/models").json()["models"] if m["loaded"]}
                == {"cmos", "sdsrl"}
            ),
            30,
            "both models loaded",
        )
        found = http.post(
            "/v1/search",
            json={"model": ENSEMBLE, "modality": "image", "vector": q.img.tolist(), "k": 5},
        )
        assert found.status_code == 200, found.text
        body = found.json()
        assert body["version"] is None and body["index_version"] is None
        assert set(body["members"]) == {"cmos", "sdsrl"} and len(body["results"]) == 5
        scores = [h["score"] for h in body["results"]]
        assert scores == sorted(scores, reverse=True)
        sim = http.post(
            "/v1/similarity",
            json={
                "model": ENSEMBLE,
                "images": [q.img.tolist()],
                "mode": "matrix",
                "texts": [pairs[int(h["id"])].txt.tolist() for h in body["results"]],
            },
        ).json()
        np.testing.assert_allclose(sim["scores"][0], scores, rtol=1e-5)
        assert sim["members"] == body["members"]
        pinned = http.post(
            "/v1/search",
            json={"model": ENSEMBLE, "version": 1, "modality": "image", "vector": q.img.tolist()},
        )
        assert pinned.status_code == 422 and pinned.json()["detail"][0]["loc"][-1] == "version"
        unknown = http.post(
            "/v1/similarity",
            json={
                "model": "ensemble:cmos+x",
                "images": [q.img.tolist()],
                "texts": [q.txt.tolist()],
            },
        )
        assert unknown.status_code == 422 and "unknown model 'x'" in unknown.text
        # Every ensemble shares one metric label, whatever a client writes.
        http.post(
            "/v1/search",
            json={"model": "ensemble:sdsrl*2+cmos", "modality": "text", "vector": q.txt.tolist()},
        ).raise_for_status()
        text = http.get("/metrics").text
        assert metric(text, "streamxm_served_version_lag_seconds_count", model="ensemble") == 2
        assert "ensemble:" not in text


@pytest.mark.long
def test_bench_quality_scores_an_ensemble_beside_its_members() -> None:
    fused = quality("wiki", "ensemble:cca+pairwise:marginal")
    alone = {m: quality("wiki", m) for m in ("cca", "pairwise:marginal")}
    for member, result in alone.items():
        got = fused["members"][member]
        assert (got["map_i2t"], got["map_t2i"]) == (result["map_i2t"], result["map_t2i"])
    # Fusing the two beats the better of them on the mean of both directions (seed 0).
    assert fused["best_member"] == "pairwise:marginal"
    assert fused["mean_map"] > fused["best_member_mean_map"] + 0.001


def test_member_by_member_search_stops_on_the_same_fused_top_k(
    r: redis.Redis, learned: tuple[Settings, list], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With few candidates (4 k = 20 of 300 per member), the threshold stop of the
    member-by-member search (used when a member has no exact float32 rows over the gallery)
    must still find the fused space's exact top k (asking the members for more when the
    threshold is not met)."""
    settings, pairs = learned
    server = ModelServer(r, open_store(settings, r), settings.namespace, candidates=1)
    server.refresh()
    queries = [("image", pairs[i].img.astype(np.float32)) for i in (7, 40, 200)] + [
        ("text", pairs[i].txt.astype(np.float32)) for i in (9, 120)
    ]
    fused = [server.search(ENSEMBLE, m, q, k=5).hits for m, q in queries]
    from streamxm.serving.fused import FusedSpace

    monkeypatch.setattr(FusedSpace, "sources_of", staticmethod(lambda *args: None))
    members = [server.search(ENSEMBLE, m, q, k=5).hits for m, q in queries]
    for got, want in zip(members, fused, strict=True):
        assert [h[0] for h in got] == [h[0] for h in want]
        np.testing.assert_allclose([h[1] for h in got], [h[1] for h in want], rtol=1e-5)
