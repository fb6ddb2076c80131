"""``streamxm demo``: embedded Redis + CMOS worker + API, the Wikipedia pairs replayed through
the stream, a live progress line, and the served model's test-split mAP at the end."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import redis
from tqdm import tqdm

from streamxm.client import Client, ModelInfo, Unavailable
from streamxm.config import Settings
from streamxm.learning.evaluation import label_relevance, mean_average_precision
from streamxm.stream.keys import Keys
from streamxm.stream.messages import Pair
from streamxm.stream.redis_conn import EmbeddedRedis, connect
from streamxm.tools.datasets import PUBLISHED_WIKI, bundled_wiki_path, iter_pairs, load_dataset
from streamxm.tools.processes import Child
from streamxm.tools.waiting import wait_for

__all__ = ["render", "run_demo"]


def run_demo(
    pairs: int | None = None,
    as_json: bool = False,
    port: int = 8765,
    rate: float | None = None,
    dataset: str | None = None,
    model: str = "cmos",
    timeout: float = 600.0,
) -> dict[str, Any]:
    settings = Settings()
    path = dataset or str(bundled_wiki_path())
    ds = load_dataset(path)
    n = len(ds.img_train) if pairs is None else max(1, min(pairs, len(ds.img_train)))
    namespace = "demo"
    embedded = None
    url = settings.redis_url
    if url is None:
        embedded = EmbeddedRedis(settings.data_dir / "redis", settings.redis_appendfsync)
        url = embedded.start(join=True)
    r = connect(settings, url)
    _fresh_namespace(r, Keys(namespace))
    log_dir = settings.data_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "STREAMXM_REDIS_URL": url,
        "STREAMXM_NAMESPACE": namespace,
        "STREAMXM_API_PORT": str(port),
        "STREAMXM_DEFAULT_MODEL": model,
    }
    env.pop("STREAMXM_API_TOKEN", None)
    try:
        with (
            Child("worker", "--model", model, env=env, log=log_dir / "worker.log"),
            Child(
                "api", "--host", "127.0.0.1", "--port", str(port), env=env, log=log_dir / "api.log"
            ) as api,
            Client(f"http://127.0.0.1:{port}", timeout=60) as client,
        ):
            wait_for(lambda: api.alive() and client.health(), 60, "the API to start", interval=0.1)
            start = time.monotonic()
            info = _replay(
                client, list(iter_pairs(ds, limit=n)), model, rate, timeout, quiet=as_json
            )
            learn_seconds = time.monotonic() - start
            # The whole test split scored by the served model, over HTTP, by one version.
            served = client.similarity(ds.img_test, ds.txt_test, mode="matrix", model=model)
            scores, version = served.scores, served.version
    finally:
        redis_note = (
            "Redis is the one STREAMXM_REDIS_URL names: it keeps running."
            if embedded is None
            else _sentence(embedded.leave())
        )
    rel = label_relevance(ds.y_test, ds.y_test)
    return {
        "model": model,
        "dataset": Path(path).name,
        "pairs": n,
        "served_version": version,
        "map_i2t": mean_average_precision(scores, rel),
        "map_t2i": mean_average_precision(scores.T, rel.T),
        "mistakes": info.mistakes,
        "triplets": info.triplets,
        "rolling_map": info.rolling_map,
        "learn_seconds": round(learn_seconds, 2),
        "logs": str(log_dir),
        "redis": redis_note,
        "published": {
            k: {"map_i2t": v[0], "map_t2i": v[1], "source": v[2]} for k, v in PUBLISHED_WIKI.items()
        },
    }


def _fresh_namespace(r: redis.Redis, keys: Keys) -> None:
    """Delete an earlier demo's keys (also under the untagged names of older versions): they
    would mix into the figures."""
    stale = [
        *r.scan_iter(match=f"{keys.prefix}:*", count=1000),
        *r.scan_iter(match=f"{keys.legacy_prefix}:*", count=1000),
    ]
    if stale:
        r.delete(*stale)


def _replay(
    client: Client, train: list[Pair], model: str, rate: float | None, timeout: float, quiet: bool
) -> ModelInfo:
    """Push the training pairs through the API (at ``rate`` pairs/s if given) with a live line
    of what the API reports, until the served version holds every pair; the model's last
    state."""
    n, start = len(train), time.monotonic()
    # One rate on the line: the pairs the worker has learned, from the API's /v1/models
    # (tqdm's own rate would count how fast the line was updated).
    bar_format = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} pairs [{elapsed}]{postfix}"
    with tqdm(
        total=n,
        file=sys.stderr,
        desc=f"{model} learned",
        bar_format=bar_format,
        disable=quiet,
        dynamic_ncols=True,
    ) as bar:

        def show() -> ModelInfo | None:
            info = next((m for m in client.models() if m.name == model), None)
            if info is None:
                return None
            bar.update(info.pairs_seen - bar.n)
            bar.set_postfix_str(_live(info, time.monotonic() - start), refresh=True)
            return info

        last_show = 0.0
        for i in range(0, n, 100):
            client.push(train[i : i + 100])
            if rate:
                time.sleep(len(train[i : i + 100]) / rate)
            if time.monotonic() - last_show > 0.5:
                show()
                last_show = time.monotonic()

        def caught_up() -> ModelInfo | None:
            info = show()
            done = info is not None and info.pairs_seen == n
            return info if done and info and info.version == info.checkpoint_version else None

        found: ModelInfo = wait_for(
            caught_up,
            timeout,
            "the worker to learn every pair",
            interval=0.25,
            tolerate=(Unavailable,),
        )
    return found


def _live(info: ModelInfo, seconds: float) -> str:
    """The live line's numbers: the learning rate, mistakes as a share of the triplets scored
    (each pair is learned as several triplets per direction) and the rolling mAP."""

    def share(direction: str) -> str:
        triplets = info.triplets.get(direction, 0)
        return f"{info.mistakes.get(direction, 0) / triplets:.0%}" if triplets else "-"

    return (
        f"{info.pairs_seen / max(seconds, 1e-9):.0f} pairs/s | mistaken triplets "
        f"i2t {share('i2t')} t2i {share('t2i')} | rolling mAP i2t "
        f"{_fmt(info.rolling_map.get('i2t'))} t2i {_fmt(info.rolling_map.get('t2i'))}"
    )


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
        lines.append(
            f"  {name:40s} {fig['map_i2t']:11.4f} {fig['map_t2i']:11.4f}   ({fig['source']})"
        )
    lines += [
        "",
        "The worker and the API have stopped. " + result["redis"],
        "Next:",
        f"  logs of this run:  {result['logs']}/worker.log and api.log",
        "  run it yourself:   streamxm worker --model cmos &   then   streamxm api",
        "  push and query:    streamxm push --dataset wiki --url http://127.0.0.1:8000",
        "                     (or streamxm.client.Client: README, 'Push pairs and query')",
        "  watch it:          streamxm top --url http://127.0.0.1:8000",
    ]
    return "\n".join(lines)


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:] + "."
