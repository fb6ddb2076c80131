"""``streamxm bench query``: ``/v1/search`` latency and throughput from concurrent clients over
a large gallery while a worker learns and the API swaps new checkpoints in, with recall@10
against the served version's exact ranking; ``ensemble_recall`` for an ensemble's search."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import numpy as np
from numpy.typing import NDArray
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from streamxm.learning.stream_learner import model_from_state
from streamxm.models import CrossModalModel
from streamxm.models.ensemble import (
    REFERENCE_ITEMS,
    Ensemble,
    is_ensemble,
    parse_ensemble,
)
from streamxm.service import open_store
from streamxm.serving.gallery import reference_rows
from streamxm.storage.checkpoint import CheckpointStore
from streamxm.storage.segments import read_manifest
from streamxm.stream.messages import (
    make_pair,
)
from streamxm.stream.producer import StreamProducer
from streamxm.stream.redis_conn import text
from streamxm.stream.retention import entry_id_key
from streamxm.tools.datasets import synthetic_arrays, synthetic_pairs
from streamxm.tools.rawhttp import Answer, run_clients
from streamxm.tools.stack import (
    NAMESPACE,
    Stack,
    cpu_seconds,
    percentile,
    rss_mb,
    stack,
)
from streamxm.tools.waiting import wait_for

__all__ = ["ensemble_recall", "metric_value", "query"]


def metric_value(text: str, name: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    return None


def _recall(
    st: Stack,
    model: str,
    answers: list[Answer],
    queries: list[tuple[str, Any]],
    imgs: NDArray[np.float32],
    txts: NDArray[np.float32],
    k: int,
    sample: int,
    seed: int,
) -> float | None:
    """Mean recall@k of sampled answers against the exact ranking (ties in row order) by the
    version that served each (an ensemble: its members' versions, fused over the API's
    reference sample), loaded from the store, which the benchmark tells to keep every
    version. Scores are the similarity's (:func:`member_scores`); each version scores the
    gallery once per target modality."""
    if not answers:
        return None
    store = open_store(st.settings, st.r)
    rng = np.random.default_rng(seed)
    picked = [
        answers[i] for i in rng.choice(len(answers), min(sample, len(answers)), replace=False)
    ]
    picked.sort(key=lambda a: a.versions)
    recalls: list[float] = []
    versions: tuple[tuple[str, int], ...] = ()
    scorer: _ExactScores | None = None
    for answer in tqdm(picked, desc="recall against exact rankings", file=sys.stderr):
        if answer.versions != versions:
            versions = answer.versions
            models = _load_versions(store, answer.versions)
            scorer = _ExactScores(model, models, imgs, txts) if models else None
        if scorer is None:
            continue
        modality, vector = queries[answer.body]
        scores = scorer.scores(modality, vector)
        exact = np.argsort(-scores, kind="stable")[:k].tolist()
        got = {int(i[1:]) for i in answer.ids}  # ids are "s<row>"
        recalls.append(len(got & set(exact)) / k)
    return round(float(np.mean(recalls)), 4) if recalls else None


def _load_versions(
    store: CheckpointStore, versions: tuple[tuple[str, int], ...]
) -> dict[str, CrossModalModel] | None:
    models = {}
    for name, version in versions:
        ckpt = store.load(name, version)
        if ckpt is None:
            return None
        models[name] = model_from_state(ckpt.arrays, ckpt.meta)
    return models


class _ExactScores:
    """The served scores of a query against every gallery item by one version of ``model`` (an
    ensemble: its members' versions), from each member's embeddings of the gallery, made once
    per target modality (the models' contract: the similarity is their inner product)."""

    def __init__(
        self,
        model: str,
        models: dict[str, CrossModalModel],
        imgs: NDArray[np.float32],
        txts: NDArray[np.float32],
    ) -> None:
        self.model, self.models = model, models
        self.items = {"image": imgs, "text": txts}
        self._embedded: dict[tuple[str, str], NDArray[np.float64]] = {}
        # The gallery's ids are "s<row>" (_fill_gallery).
        self.reference = reference_rows([f"s{i}" for i in range(len(imgs))], REFERENCE_ITEMS)

    def _gallery(self, member: str, target: str) -> NDArray[np.float64]:
        if (member, target) not in self._embedded:
            model, rows = self.models[member], self.items[target]
            embed = model.embed_images if target == "image" else model.embed_texts
            self._embedded[(member, target)] = np.concatenate(
                [
                    embed(rows[i : i + 50_000]).astype(np.float64)
                    for i in range(0, len(rows), 50_000)
                ]
            )
        return self._embedded[(member, target)]

    def _member(
        self, member: str, modality: str, vector: NDArray[np.float32]
    ) -> NDArray[np.float64]:
        model = self.models[member]
        embed = model.embed_images if modality == "image" else model.embed_texts
        target = "text" if modality == "image" else "image"
        query = embed(vector[None, :]).astype(np.float64)[0]
        return np.asarray(self._gallery(member, target) @ query)

    def scores(self, modality: str, vector: NDArray[np.float32]) -> NDArray[np.float64]:
        if not is_ensemble(self.model):
            return self._member(self.model, modality, vector)
        target = "text" if modality == "image" else "image"
        items = self.items[target]
        rows = self.reference  # the API's sample
        fused = Ensemble(parse_ensemble(self.model), self.models)
        direction = "i2t" if modality == "image" else "t2i"
        standards = fused.standardisers(direction, vector[None, :], items[rows])
        total = np.zeros(len(items))
        for member, (offset, scale) in zip(fused.spec.members, standards, strict=True):
            total += (self._member(member, modality, vector) - offset[0]) / scale[0]
        return total


def query(
    gallery: int = 100_000,
    img_dim: int = 512,
    txt_dim: int = 128,
    clients: int = 32,
    seconds: float = 30.0,
    k: int = 10,
    model: str = "cmos",
    recall_sample: int = 200,
    candidates: int = 100,
    seed: int = 0,
    wait_for_index: bool = True,
    gallery_backend: str = "local",
    shards: int = 2,
) -> dict[str, Any]:
    """``/v1/search`` under ``clients`` concurrent connections for ``seconds`` while a worker
    learns from the stream and checkpoints every 2 s; image and text queries alternate.

    The gallery is :func:`~streamxm.tools.datasets.synthetic_pairs` (non-negative rows around
    100 cluster centres, like bag-of-words histograms), so an index that relies on the items'
    structure gets the structure real features have. A gallery indexer writes the segments the
    API opens; the load starts once the API serves the whole gallery and the indexer has
    covered every pushed pair (steady state). Afterwards a second API process is started on
    the same data and timed until it serves the whole gallery (``replica_ready_s``), and a
    sample of answers is compared with the exact ranking of the version that served each
    (``recall_at_10``).

    ``gallery_backend="ray"``: the API holds the gallery in ``shards`` shard actors on a Ray
    cluster it starts on this machine (:mod:`streamxm.ray_gallery`); ``shard_rss_mb`` and
    ``cores_used`` name each shard. Ray must stay on loopback, so this runs only in a network
    namespace with no other interface (``unshare -rn``); no replica is timed (a second API
    would start a cluster of its own)."""
    imgs, txts, classes = synthetic_arrays(gallery, img_dim, txt_dim, n_classes=100, seed=seed)
    queries = _search_queries(imgs, txts, seed)
    bodies = [
        json.dumps({"model": model, "modality": m, "k": k, "vector": v.tolist()}).encode()
        for m, v in queries
    ]
    with stack(
        **_stack_settings(gallery, candidates, wait_for_index, gallery_backend, shards)
    ) as st:
        _fill_gallery(st, imgs, txts, classes)
        members = parse_ensemble(model).members if is_ensemble(model) else (model,)
        url, api_pid, pids = _start_service(st, members)
        served = _steady_state(st, url, members, gallery)
        pids.update(ray_processes() if gallery_backend == "ray" else {})  # shards, Ray daemons
        before = sum(st.processed(m) for m in members)
        load = _timed_load(url, bodies, clients, seconds, pids)
        learned = sum(st.processed(m) for m in members) - before
        api_rss = rss_mb(api_pid)
        exact_scans = metric_value(
            httpx.get(f"{url}/metrics", timeout=30).text, "streamxm_search_exact_scans_total"
        )
        shard_rss = _shard_rss_mb(url)
        replica_ready = _replica_ready_seconds(st, served) if gallery_backend == "local" else None
        recall = _recall(st, model, load.answers, queries, imgs, txts, k, recall_sample, seed)
    return {
        "benchmark": "query",
        "gallery": gallery,
        "img_dim": img_dim,
        "txt_dim": txt_dim,
        "model": model,
        "k": k,
        "clients": clients,
        "candidates": candidates,
        "wait_for_index": wait_for_index,
        "gallery_backend": gallery_backend,
        "shards": shards if gallery_backend == "ray" else None,
        **load.latency_figures(),
        "recall_at_10": recall,
        **_version_figures(load.answers),
        "pairs_learned_meanwhile": learned,
        "api_rss_mb": round(api_rss, 1),
        "shard_rss_mb": shard_rss,
        "gallery_float32_mb": round(gallery * (img_dim + txt_dim) * 4 / 2**20, 1),
        "replica_ready_s": round(replica_ready, 2) if replica_ready is not None else None,
        **load.cpu_figures(),
        # Searches whose int8/bfloat16 candidates were not proven complete: a float32 scan answered.
        "exact_scans": exact_scans,
    }


def _stack_settings(
    gallery: int, candidates: int, wait_for_index: bool, gallery_backend: str, shards: int
) -> dict[str, Any]:
    """The settings of :func:`query`'s stack. Checkpoints and segments on disk (the
    directory store): Redis then holds only the stream. Ray's backend only where it cannot
    listen beyond loopback (:func:`require_loopback_only`), with the indexer's segments cut
    into one part per shard (each shard reads its own); the local backend's in one part."""
    if gallery_backend == "ray":
        require_loopback_only()
    return {
        "gallery_max": gallery,
        "checkpoint_every_seconds": 2.0,
        "checkpoint_keep": 1000,
        "checkpoint_store": "dir",
        "search_candidates": candidates,
        "wait_for_index": wait_for_index,
        "gallery_backend": gallery_backend,
        "gallery_shards": shards,
        "gallery_parts": shards if gallery_backend == "ray" else 1,
        "shard_timeout_seconds": 30.0,
    }


def ray_processes() -> dict[str, int]:
    """This machine's shard actors (``shard 1``, ``shard 2``, ... by pid) and Ray's daemons
    (``raylet``, ``gcs_server``), by their command lines in ``/proc``."""
    shards, daemons = [], {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        if argv.startswith("ray::ShardHost"):
            shards.append(int(entry.name))
        elif argv.rpartition("/")[2] in ("raylet", "gcs_server"):
            daemons[argv.rpartition("/")[2]] = int(entry.name)
    return {**{f"shard {i}": pid for i, pid in enumerate(sorted(shards), 1)}, **daemons}


def _shard_rss_mb(url: str) -> list[float] | None:
    """Each gallery shard's resident memory as ``/readyz`` names it (``None``: no shards)."""
    shards = httpx.get(f"{url}/readyz", timeout=30).json().get("shards") or []
    return [round(s["resident_bytes"] / 2**20, 1) for s in shards] or None


def _version_figures(answers: list[Answer]) -> dict[str, Any]:
    """How old the answering versions were, and how many answered."""
    lags = [a.lag_s for a in answers]
    return {
        "served_version_lag_p99_s": round(percentile(lags, 99), 3) if lags else None,
        "model_versions_served": len({a.versions for a in answers}),
    }


def require_loopback_only() -> None:
    """Refuse to start Ray where it could listen beyond this machine: every network interface
    but loopback must be absent (run the benchmark under ``unshare -rn``)."""
    interfaces = sorted(name for _, name in socket.if_nameindex())
    if interfaces != ["lo"]:
        raise SystemExit(
            f"the ray gallery backend starts Ray, which listens on {interfaces}: run the "
            "benchmark in a network namespace with loopback only: unshare -rn sh -c 'ip link "
            "set lo up && streamxm bench query --gallery-backend ray ...'"
        )


def _search_queries(
    imgs: NDArray[np.float32], txts: NDArray[np.float32], seed: int
) -> list[tuple[str, Any]]:
    """The 64 queries the clients cycle through: gallery items' own vectors, text and image
    alternating."""
    rng = np.random.default_rng(seed + 1)
    queries: list[tuple[str, Any]] = []
    for j in range(64):
        row = int(rng.integers(len(imgs)))
        queries.append(("image", imgs[row]) if j % 2 else ("text", txts[row]))
    return queries


def _fill_gallery(
    st: Stack, imgs: NDArray[np.float32], txts: NDArray[np.float32], classes: NDArray[Any]
) -> None:
    """Push the gallery's pairs (ids ``s<row>``) into the stream, 5,000 at a time."""
    client = StreamProducer(st.r, NAMESPACE)
    gallery = len(imgs)
    for i in tqdm(range(0, gallery, 5000), desc="filling the gallery", file=sys.stderr):
        client.push_pairs(
            [
                make_pair(f"s{j}", imgs[j], txts[j], labels=[int(classes[j])])
                for j in range(i, min(gallery, i + 5000))
            ]
        )


def _start_service(st: Stack, members: tuple[str, ...]) -> tuple[str, int, dict[str, int | None]]:
    """A worker per model of ``members``, the gallery indexer and the API: the API's URL and
    pid, and every process's pid by name (the load generator's None: this process)."""
    workers = [st.spawn("worker", "--model", member) for member in members]
    indexer = st.spawn("indexer")
    url = st.api()
    api = st.procs[-1]
    pids = {
        **{f"worker {m}": w.pid for m, w in zip(members, workers, strict=True)},
        "indexer": indexer.pid,
        "api": api.pid,
        "load_generator": None,
    }
    return url, api.pid, pids


class _Load(NamedTuple):
    """What the load of :func:`query` measured."""

    latencies: list[float]  # seconds per request
    statuses: dict[str, int]  # requests per HTTP status
    answers: list[Answer]
    elapsed: float  # seconds the load ran
    cpu: dict[str, float]  # cores each process used meanwhile
    refusals: dict[str, int]  # non-200 answers by status and detail (the first few kinds)

    def latency_figures(self) -> dict[str, Any]:
        ms = [x * 1000 for x in self.latencies]
        return {
            "seconds": round(self.elapsed, 2),
            "requests": len(ms),
            "requests_per_s": round(len(ms) / self.elapsed, 1),
            "p50_ms": round(percentile(ms, 50), 2),
            "p90_ms": round(percentile(ms, 90), 2),
            "p99_ms": round(percentile(ms, 99), 2),
            "max_ms": round(max(ms), 2) if ms else None,
            "errors": sum(n for code, n in self.statuses.items() if code != "200"),
            "statuses": self.statuses,
            "refusals": self.refusals,
        }

    def cpu_figures(self) -> dict[str, Any]:
        requests = max(1, len(self.latencies))
        return {
            # Cores each process used during the load (the machine has os.cpu_count() of them).
            "cores_used": self.cpu,
            "cores": os.cpu_count(),
            "api_cpu_ms_per_request": round(1000 * self.cpu["api"] * self.elapsed / requests, 2),
            # With the ray backend: CPU all shards together spent per search.
            "shards_cpu_ms_per_request": round(
                1000
                * sum(c for n, c in self.cpu.items() if n.startswith("shard "))
                * self.elapsed
                / requests,
                2,
            )
            if any(n.startswith("shard ") for n in self.cpu)
            else None,
        }


def _timed_load(
    url: str, bodies: list[bytes], clients: int, seconds: float, pids: dict[str, int | None]
) -> _Load:
    """``clients`` connections posting ``bodies`` to ``/v1/search`` for ``seconds``, and the
    cores each process of ``pids`` (None: this one) used meanwhile."""
    cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    start = time.perf_counter()
    refusals: dict[str, int] = {}
    latencies, statuses, answers = asyncio.run(run_clients(url, bodies, clients, seconds, refusals))
    elapsed = time.perf_counter() - start
    cpu = {
        name: round((cpu_seconds(pid) - cpu_before[name]) / elapsed, 2)
        for name, pid in pids.items()
    }
    return _Load(latencies, statuses, answers, elapsed, cpu, refusals)


def _replica_ready_seconds(st: Stack, served: Callable[[str], bool]) -> float:
    """Seconds until a second API process on the same data serves the whole gallery."""
    ready_start = time.perf_counter()
    replica = st.api()
    wait_for(lambda: served(replica), 900, "a second API to load the whole gallery")
    return time.perf_counter() - ready_start


def _steady_state(
    st: Stack, url: str, members: tuple[str, ...], gallery: int
) -> Callable[[str], bool]:
    """Wait until the API at ``url`` serves every model of ``members`` over the whole gallery
    and the indexer
    has written every pushed pair into segments (the API can serve the whole gallery earlier,
    from the stream tail, while the indexer catches up); the check of the first, for replicas."""

    def served(at: str) -> bool:
        response = httpx.get(f"{at}/v1/models", timeout=10)
        if response.status_code != 200:  # 503 while Redis is busy with the gallery load
            return False
        loaded = {
            m["name"]
            for m in response.json()["models"]
            if m["loaded"] and m["gallery_items"] >= gallery
        }
        return loaded.issuperset(members)

    wait_for(lambda: served(url), 900, "the API to load a model and the whole gallery")
    pushed = text(st.r.xinfo_stream(st.keys.pairs)["last-generated-id"])

    def indexed() -> bool:
        manifest = read_manifest(st.r, st.keys)
        return manifest is not None and entry_id_key(manifest.last_id) >= entry_id_key(pushed)

    wait_for(indexed, 900, "the gallery indexer to cover every pushed pair")
    return served


def ensemble_recall(
    model: str = "ensemble:cmos+sdsrl",
    gallery: int = 20_000,
    img_dim: int = 128,
    txt_dim: int = 32,
    queries: int = 100,
    k: int = 10,
    candidates: int = 100,
    seed: int = 0,
) -> dict[str, Any]:
    """Recall@k of an ensemble's search against the exact fused ranking of the whole gallery.

    Every member learns the gallery's pairs (:func:`~streamxm.tools.datasets.synthetic_pairs`,
    100 topics) in-process from a private Redis; a :class:`ModelServer` then answers
    ``queries`` searches (image and text alternating, each a gallery item's own vector) the way
    the API does, each member proposing ``max(candidates, 4k)`` candidates; the reference is
    every gallery item scored by the same fused score (same members' versions, same reference
    sample)."""
    from streamxm.models.ensemble import parse_ensemble
    from streamxm.service import build_worker
    from streamxm.serving.served import direction_of, other_modality
    from streamxm.serving.server import ModelServer

    spec = parse_ensemble(model)
    pairs = synthetic_pairs(gallery, img_dim, txt_dim, n_classes=100, seed=seed)
    vectors = {"image": np.stack([p.img for p in pairs]), "text": np.stack([p.txt for p in pairs])}
    with stack(gallery_max=gallery) as st:
        StreamProducer(st.r, NAMESPACE).push_pairs(pairs)
        for member in tqdm(spec.members, desc="members learning", file=sys.stderr):
            build_worker(st.settings, st.r, member).run(until_idle=True)
        server = ModelServer(
            st.r,
            open_store(st.settings, st.r),
            NAMESPACE,
            gallery_max=gallery,
            candidates=candidates,
        )
        while len(server.gallery) < gallery or len(server.served) < len(spec.members):
            server.refresh()
        fused = server.ensemble(model)
        rng = np.random.default_rng(seed + 1)
        recalls = []
        for j in tqdm(range(queries), desc="queries", file=sys.stderr):
            modality = "image" if j % 2 else "text"
            query = vectors[modality][int(rng.integers(gallery))]
            found = {i for i, _ in server.search(model, modality, query, k).hits}
            target = other_modality(modality)
            exact = fused.fused.scores(
                direction_of(modality),
                query[None, :],
                vectors[target],
                server.gallery.reference(target, REFERENCE_ITEMS),
            )[0]
            best = {pairs[i].id for i in np.argsort(-exact, kind="stable")[:k]}
            recalls.append(len(found & best) / k)
    return {
        "benchmark": "ensemble-recall",
        "model": model,
        "gallery": gallery,
        "img_dim": img_dim,
        "txt_dim": txt_dim,
        "queries": queries,
        "k": k,
        "candidates_per_member": max(candidates, 4 * k),
        "recall_at_k": round(float(np.mean(recalls)), 4),
        "min_recall_at_k": round(float(np.min(recalls)), 2),
    }
