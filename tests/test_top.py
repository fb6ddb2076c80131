"""``streamxm top`` against a real API fed by a real worker."""

import threading

import pytest
import redis

from streamxm.cli import main
from streamxm.config import Settings
from streamxm.service import build_worker
from streamxm.stream.producer import StreamProducer
from streamxm.tools.top import parse, render
from tests.conftest import ApiServer, class_stream, free_port, wait_for


def test_top_shows_each_models_health(
    r: redis.Redis, settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    stop = threading.Event()
    threads = [
        threading.Thread(target=build_worker(settings, r, name).run, args=(stop,), daemon=True)
        for name in ("cmos", "pairwise")
    ]
    for thread in threads:
        thread.start()
    try:
        with ApiServer(settings) as api:
            StreamProducer(r, settings.namespace).push_pairs(class_stream(400, 6, 4, seed=2))
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

            # An ensemble query labels the API's lag histogram with the ensemble's name: it
            # is no learner, so it gets no row.
            wait_for(
                lambda: "pairwise" in parse(httpx.get(api.url + "/metrics").text)[1],
                30,
                "the pairwise learner",
            )
            name = "ensemble:cmos+pairwise"
            wait_for(
                lambda: (
                    httpx.post(
                        api.url + "/v1/search",
                        json={
                            "model": name,
                            "modality": "image",
                            "vector": [0.5] * 6,
                            "k": 3,
                        },
                    ).status_code
                    == 200
                ),
                30,
                "an ensemble answer",
            )
            text = httpx.get(api.url + "/metrics").text
            assert 'model="ensemble"' in text  # the lag histogram's label for any ensemble
            assert set(parse(text)[1]) == {"cmos", "pairwise"}
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
    assert main(["top", "--once", "--url", f"http://127.0.0.1:{free_port()}"]) == 2
    assert "cannot read" in capsys.readouterr().err
