"""``streamxm top`` against a real API fed by a real worker."""

import threading

import pytest
import redis

from streamxm.cli import main
from streamxm.config import Settings
from streamxm.service import build_worker
from streamxm.stream.client import StreamClient
from streamxm.tools.top import parse, render
from tests.conftest import ApiServer, class_stream, free_port, wait_for


def test_top_shows_each_models_health(r: redis.Redis, settings: Settings,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    stop = threading.Event()
    worker = build_worker(settings, r, "cmos")
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    try:
        with ApiServer(settings) as api:
            StreamClient(r, settings.namespace).push_pairs(class_stream(400, 6, 4, seed=2))
            import httpx

            def learned() -> bool:
                _, models = parse(httpx.get(api.url + "/metrics").text)
                return "cmos" in models and models["cmos"].processed == 400

            wait_for(learned, 30, "the worker to learn 400 pairs")
            ingested, models = parse(httpx.get(api.url + "/metrics").text)
            cmos = models["cmos"]
            assert ingested == 400 and cmos.lag == 0
            assert cmos.mistakes["i2t"] > 0 and cmos.triplets["i2t"] >= cmos.mistakes["i2t"]
            assert 0 < cmos.rolling_map["t2i"] <= 1 and cmos.checkpoint_age is not None
            frame = render(ingested, models)
            row = next(line for line in frame.splitlines() if line.startswith("cmos"))
            ratio = cmos.mistakes["i2t"] / cmos.triplets["i2t"]
            assert "400" in row and f"{ratio:.3f}" in row
            assert f"{cmos.rolling_map['i2t']:.3f}" in row

            assert main(["top", "--once", "--url", api.url]) == 0
            assert "cmos" in capsys.readouterr().out
    finally:
        stop.set()
        thread.join(timeout=30)
    assert main(["top", "--once", "--url", f"http://127.0.0.1:{free_port()}"]) == 2
    assert "cannot read" in capsys.readouterr().err
