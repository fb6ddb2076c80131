"""``streamxm demo``: embedded Redis + CMOS worker + API, the Wikipedia pairs replayed through
the stream, a live progress line, and the served model's test-split mAP at the end."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import redis
from tqdm import tqdm

from streamxm.config import Settings
from streamxm.learning.evaluation import label_relevance, mean_average_precision
from streamxm.stream.client import StreamClient
from streamxm.stream.keys import Keys
from streamxm.stream.messages import Pair
from streamxm.stream.redis_conn import EmbeddedRedis, connect
from streamxm.tools.datasets import PUBLISHED_WIKI, bundled_wiki_path, iter_pairs, load_dataset
from streamxm.tools.processes import Child
from streamxm.tools.waiting import wait_for

__all__ = ["run_demo", "served_scores"]


def served_scores(http: httpx.Client, model: str, imgs: np.ndarray[Any, Any],
                  txts: np.ndarray[Any, Any], block: int = 512) -> tuple[np.ndarray[Any, Any], int]:
    """The full image x text score matrix from ``POST /v1/similarity`` (in blocks)."""
    scores = np.zeros((len(imgs), len(txts)))
    versions = set()
    for i in range(0, len(imgs), block):
        for j in range(0, len(txts), block):
            reply = http.post("/v1/similarity", json={
                "model": model, "mode": "matrix",
                "images": imgs[i : i + block].tolist(), "texts": txts[j : j + block].tolist()})
            reply.raise_for_status()
            body = reply.json()
            versions.add(body["version"])
            scores[i : i + block, j : j + block] = np.asarray(body["scores"])
    if len(versions) != 1:
        raise RuntimeError(f"the served model changed during evaluation: {versions}")
    return scores, versions.pop()


def run_demo(pairs: int | None = None, as_json: bool = False, port: int = 8765,
             rate: float | None = None, dataset: str | None = None,
             model: str = "cmos", timeout: float = 600.0) -> dict[str, Any]:
    settings = Settings()
    path = dataset or str(bundled_wiki_path())
    ds = load_dataset(path)
    n = len(ds.img_train) if pairs is None else max(1, min(pairs, len(ds.img_train)))
    namespace = "demo"
    embedded = None
    url = settings.redis_url
    if url is None:
        embedded = EmbeddedRedis(settings.data_dir / "redis")
        url = embedded.start()
    r = connect(settings, url)
    _fresh_namespace(r, Keys(namespace))
    log_dir = settings.data_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "STREAMXM_REDIS_URL": url, "STREAMXM_NAMESPACE": namespace,
           "STREAMXM_API_PORT": str(port), "STREAMXM_DEFAULT_MODEL": model}
    env.pop("STREAMXM_API_TOKEN", None)
    try:
        with (Child("worker", "--model", model, env=env, log=log_dir / "worker.log"),
              Child("api", "--host", "127.0.0.1", "--port", str(port), env=env,
                    log=log_dir / "api.log") as api,
              httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http):
            wait_for(lambda: api.alive() and http.get("/healthz").status_code == 200,
                     60, "the API to start", interval=0.1, tolerate=(httpx.HTTPError,))
            start = time.monotonic()
            info = _replay(http, StreamClient(r, namespace), list(iter_pairs(ds, limit=n)),
                           model, rate, timeout, quiet=as_json)
            learn_seconds = time.monotonic() - start
            scores, version = served_scores(http, model, ds.img_test, ds.txt_test)
    finally:
        if embedded is not None and embedded.started_here:
            embedded.stop()
    rel = label_relevance(ds.y_test, ds.y_test)
    return {
        "model": model,
        "dataset": Path(path).name,
        "pairs": n,
        "served_version": version,
        "map_i2t": mean_average_precision(scores, rel),
        "map_t2i": mean_average_precision(scores.T, rel.T),
        "mistakes": info["mistakes"],
        "rolling_map": info["rolling_map"],
        "learn_seconds": round(learn_seconds, 2),
        "published": {k: {"map_i2t": v[0], "map_t2i": v[1], "source": v[2]}
                      for k, v in PUBLISHED_WIKI.items()},
    }


def _fresh_namespace(r: redis.Redis, keys: Keys) -> None:
    """Delete an earlier demo's keys (also under the untagged names of older versions): they
    would mix into the figures."""
    stale = [*r.scan_iter(match=f"{keys.prefix}:*", count=1000),
             *r.scan_iter(match=f"{keys.legacy_prefix}:*", count=1000)]
    if stale:
        r.delete(*stale)


def _replay(http: httpx.Client, client: StreamClient, train: list[Pair], model: str,
            rate: float | None, timeout: float, quiet: bool) -> dict[str, Any]:
    """Push the training pairs (at ``rate`` pairs/s if given) with a live line of what the API
    reports, until the served version holds every pair; the model's last ``/v1/models``."""
    n, start = len(train), time.monotonic()

    def status() -> dict[str, Any]:
        for info in http.get("/v1/models").json()["models"]:
            if info["name"] == model:
                return dict(info)
        return {}

    with tqdm(total=n, unit="pair", file=sys.stderr, desc=f"{model} learned",
              disable=quiet, dynamic_ncols=True) as bar:
        def show() -> dict[str, Any]:
            info = status()
            seen = int(info.get("pairs_seen", 0))
            bar.update(seen - bar.n)
            rm = info.get("rolling_map") or {}
            mistakes = info.get("mistakes") or {}
            bar.set_postfix_str(
                f"pairs/s {seen / max(time.monotonic() - start, 1e-9):.0f} | mistakes "
                f"i2t {mistakes.get('i2t', 0)} t2i {mistakes.get('t2i', 0)} | rolling mAP"
                f" i2t {_fmt(rm.get('i2t'))} t2i {_fmt(rm.get('t2i'))}")
            return info

        last_show = 0.0
        for i in range(0, n, 100):
            client.push_pairs(train[i : i + 100])
            if rate:
                time.sleep(len(train[i : i + 100]) / rate)
            if time.monotonic() - last_show > 0.5:
                show()
                last_show = time.monotonic()

        def caught_up() -> dict[str, Any] | None:
            info = show()
            done = info.get("pairs_seen") == n
            return info if done and info["version"] == info["checkpoint_version"] else None

        found: dict[str, Any] = wait_for(caught_up, timeout, "the worker to learn every pair",
                                         interval=0.25, tolerate=(httpx.HTTPError,))
    return found


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def render(result: dict[str, Any]) -> str:
    lines = [
        f"\nServed {result['model']} v{result['served_version']} after {result['pairs']} pairs "
        f"({result['learn_seconds']} s); test split of {result['dataset']}:",
        f"  {'method':40s} {'image->text':>11s} {'text->image':>11s}",
        f"  {result['model'] + ' (this run, served by the API)':40s} "
        f"{result['map_i2t']:11.4f} {result['map_t2i']:11.4f}",
        "  published on these features:",
    ]
    for name, fig in result["published"].items():
        lines.append(f"  {name:40s} {fig['map_i2t']:11.4f} {fig['map_t2i']:11.4f}"
                     f"   ({fig['source']})")
    return "\n".join(lines)
