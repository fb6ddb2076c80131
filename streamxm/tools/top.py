"""``streamxm top``: a live terminal view of the health numbers, read from the API's
``/metrics`` (the same series Grafana shows), for people without Grafana."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["ModelHealth", "fetch", "parse", "render", "watch"]


@dataclass
class ModelHealth:
    """One model's numbers from a scrape."""

    model: str
    processed: float = 0.0
    lag: float = 0.0
    mistakes: dict[str, float] = field(default_factory=dict)
    triplets: dict[str, float] = field(default_factory=dict)
    rolling_map: dict[str, float] = field(default_factory=dict)
    checkpoint_age: float | None = None
    drift: float = 0.0
    dead_letters: float = 0.0


#: The samples a learner's statistics give (an ensemble or a query metric makes no row).
_LEARNER_SAMPLES = frozenset(
    {
        "streamxm_pairs_processed_total",
        "streamxm_stream_lag",
        "streamxm_mistakes_total",
        "streamxm_triplets_total",
        "streamxm_rolling_map",
        "streamxm_checkpoint_age_seconds",
        "streamxm_drift_detected_total",
        "streamxm_dead_letters_total",
    }
)


def parse(metrics_text: str) -> tuple[float, dict[str, ModelHealth]]:
    """The ingested-pairs total and each model's health from Prometheus exposition text."""
    ingested = 0.0
    models: dict[str, ModelHealth] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, float(sample.value)
            if name == "streamxm_pairs_ingested_total":
                ingested += value
                continue
            if "model" not in labels or name not in _LEARNER_SAMPLES:
                continue  # a row per learner: query metrics also name ensembles
            health = models.setdefault(labels["model"], ModelHealth(labels["model"]))
            direction = labels.get("direction", "")
            if name == "streamxm_pairs_processed_total":
                health.processed = value
            elif name == "streamxm_stream_lag":
                health.lag = value
            elif name == "streamxm_mistakes_total":
                health.mistakes[direction] = value
            elif name == "streamxm_triplets_total":
                health.triplets[direction] = value
            elif name == "streamxm_rolling_map":
                health.rolling_map[direction] = value
            elif name == "streamxm_checkpoint_age_seconds":
                health.checkpoint_age = value
            elif name == "streamxm_drift_detected_total":
                health.drift = value
            elif name == "streamxm_dead_letters_total":
                health.dead_letters += value
    return ingested, models


def fetch(url: str, token: str | None = None, timeout: float = 5.0) -> str:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    reply = httpx.get(url.rstrip("/") + "/metrics", headers=headers, timeout=timeout)
    reply.raise_for_status()
    return reply.text


def _pair(values: dict[str, float], fmt: str) -> str:
    return " / ".join(format(values[d], fmt) if d in values else "-" for d in ("i2t", "t2i"))


def render(
    ingested: float,
    models: dict[str, ModelHealth],
    previous: dict[str, ModelHealth] | None = None,
    seconds: float = 0.0,
) -> str:
    """A table: one row per model. With the previous scrape and the time between, the learn
    rate and the mistake ratio of the triplets learned in between."""
    header = (
        f"{'model':<20} {'pairs':>9} {'pairs/s':>8} {'lag':>7} {'mistake ratio':>15} "
        f"{'rolling mAP':>15} {'ckpt age':>8} {'drift':>5} {'dead':>5}"
    )
    lines = [f"streamxm top  ingested {ingested:,.0f}", header, "-" * len(header)]
    for name in sorted(models):
        m = models[name]
        before = (previous or {}).get(name)
        rate, ratio = "-", {}
        if before is not None and seconds > 0:
            rate = f"{(m.processed - before.processed) / seconds:.1f}"
            for d in m.mistakes:
                learned = m.triplets.get(d, 0.0) - before.triplets.get(d, 0.0)
                if learned > 0:
                    ratio[d] = (m.mistakes[d] - before.mistakes.get(d, 0.0)) / learned
        if not ratio:  # first frame, or nothing learned since: the ratio over the whole run
            ratio = {d: m.mistakes[d] / m.triplets[d] for d in m.mistakes if m.triplets.get(d)}
        age = "-" if m.checkpoint_age is None else f"{m.checkpoint_age:.0f}s"
        lines.append(
            f"{name:<20} {m.processed:>9,.0f} {rate:>8} {m.lag:>7,.0f} "
            f"{_pair(ratio, '.3f'):>15} {_pair(m.rolling_map, '.3f'):>15} {age:>8} "
            f"{m.drift:>5.0f} {m.dead_letters:>5.0f}"
        )
    if not models:
        lines.append("(no model has learned yet)")
    return "\n".join(lines)


def watch(
    url: str,
    interval: float = 2.0,
    token: str | None = None,
    frames: int | None = None,
    out: Callable[[str], None] = print,
) -> None:
    """Redraw every ``interval`` seconds (``frames`` times, or until interrupted)."""
    previous: dict[str, ModelHealth] | None = None
    last = time.monotonic()
    shown = 0
    while frames is None or shown < frames:
        now = time.monotonic()
        ingested, models = parse(fetch(url, token))
        frame = render(ingested, models, previous, now - last)
        out(frame if frames is not None else "\x1b[2J\x1b[H" + frame)
        previous, last, shown = models, now, shown + 1
        if frames is None or shown < frames:
            time.sleep(interval)
