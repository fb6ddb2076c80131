"""The ``streamxm`` command: demo, worker, api, push, bench, redis."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, TypeAlias

from streamxm.models import MODEL_NAMES
from streamxm.tools.datasets import BURST_RUN, ORDERS

__all__ = ["main", "parse_params"]


#: The namespace's entries that belong to the command line, not to the function a command runs.
_COMMAND_LINE = ("command", "bench", "func", "verbose", "json")


def _options(args: argparse.Namespace, *apart: str) -> dict[str, Any]:
    """The command's options as keyword arguments of the function it runs: the namespace less
    the command line's own entries and the ones the command passes ``apart`` (converted), with
    ``--param`` parsed into ``params``."""
    options = {k: v for k, v in vars(args).items() if k not in (*_COMMAND_LINE, *apart)}
    if "param" in options:
        options["params"] = parse_params(options.pop("param")) or None
    return options


def parse_params(items: list[str]) -> dict[str, Any]:
    """``["C=0.1", "center=false"]`` -> ``{"C": 0.1, "center": False}`` (JSON values)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--param expects KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


DATASET_HELP = (
    "benchmark .npz (docs/design.md), or a bundled one: wiki (Wikipedia), digits (signed "
    "features of another kind)"
)


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1], got {text}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _eval_every(text: str) -> int | str:
    """An argparse type: a positive integer or ``auto`` (the rolling evaluation's schedule)."""
    return "auto" if text == "auto" else _positive(text)


def _model_name(name: str) -> str:
    """An argparse type: a known model name, checked before anything is started."""
    from streamxm.models import split_name

    try:
        split_name(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name


def _cmd_demo(args: argparse.Namespace) -> int:
    from streamxm.tools.demo import render, run_demo

    result = run_demo(
        pairs=args.pairs, as_json=args.json, port=args.port, rate=args.rate, model=args.model
    )
    print(json.dumps(result) if args.json else render(result))
    return 0


def _cmd_worker(args: argparse.Namespace) -> int:
    from streamxm.config import get_settings
    from streamxm.run import run_worker

    # torchrun (and similar launchers) say the rank and world size in the environment.
    world = args.world_size or int(os.environ.get("WORLD_SIZE", "1"))
    rank = args.rank if args.rank is not None else int(os.environ.get("RANK", "0"))
    return run_worker(
        get_settings(), args.model, parse_params(args.param) or None, world=world, rank=rank
    )


def _cmd_indexer(args: argparse.Namespace) -> int:
    from streamxm.config import get_settings
    from streamxm.run import run_indexer

    return run_indexer(get_settings())


def _cmd_api(args: argparse.Namespace) -> int:
    import uvicorn

    from streamxm.config import get_settings
    from streamxm.serving.httpserver import server_options

    settings = get_settings()  # invalid settings stop here, with the setting named
    # The app is named, not imported: the library never imports the api package.
    uvicorn.run(
        "api.app:serve_app",
        factory=True,
        host=args.host or settings.api_host,
        port=args.port or settings.api_port,
        log_level="info",
        **server_options(settings),
    )
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from streamxm.tools.report import report

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    result = report(**_options(args, "models"), models=models, progress=True)
    print(Path(args.out) / "summary.md")
    for run in result["runs"]:
        print(
            f"{run['model']}: image->text {run['final']['i2t']:.4f}, "
            f"text->image {run['final']['t2i']:.4f}"
        )
    return 0


def _cmd_top(args: argparse.Namespace) -> int:
    from streamxm.config import get_settings
    from streamxm.tools.top import watch

    settings = get_settings()
    url = args.url or f"http://{settings.api_host}:{settings.api_port}"
    token = settings.api_token.get_secret_value() if settings.api_token else None
    import httpx

    try:
        watch(url, args.interval, token, frames=1 if args.once else None)
    except httpx.HTTPError as exc:
        print(f"streamxm top: cannot read {url}/metrics: {exc}", file=sys.stderr)
        return 2
    return 0


def _cmd_rollback(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from streamxm.config import get_settings
    from streamxm.service import open_store
    from streamxm.storage.checkpoint import VersionNotKept
    from streamxm.stream.keys import Keys
    from streamxm.stream.migrate import require_migrated
    from streamxm.stream.redis_conn import connect
    from streamxm.worker.rollback import history, rollback

    settings = get_settings()
    client = connect(settings)
    keys = Keys(settings.namespace)
    require_migrated(client, keys)
    store = open_store(settings, client)
    if args.to is None:  # show what a rollback could go to, and what was done before
        head = store.head(args.model) or {}
        print(
            json.dumps(
                {
                    "model": args.model,
                    "version": head.get("version"),
                    "kept": store.kept_versions(args.model),
                    "unreadable": {
                        str(v): why for v, why in store.unreadable_versions(args.model).items()
                    },
                    "history": history(client, keys, args.model),
                }
            )
        )
        return 0
    try:
        done = rollback(
            client, store, keys, args.model, args.to, lease_ms=max(30_000, settings.lease_ttl_ms)
        )
    except VersionNotKept as exc:
        print(f"streamxm rollback: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(done)))
    return 0


def _cmd_migrate_keys(args: argparse.Namespace) -> int:
    from streamxm.config import get_settings
    from streamxm.stream.keys import Keys
    from streamxm.stream.migrate import migrate_keys
    from streamxm.stream.redis_conn import connect

    settings = get_settings()
    keys = Keys(args.namespace or settings.namespace)
    renamed = migrate_keys(connect(settings), keys, dry_run=args.dry_run)
    print(
        json.dumps(
            {
                "namespace": keys.namespace,
                "dry_run": args.dry_run,
                "renamed": len(renamed),
                "keys": [new for _, new in renamed],
            }
        )
    )
    return 0


def _cmd_push(args: argparse.Namespace) -> int:
    from collections.abc import Sequence

    from streamxm.config import get_settings
    from streamxm.stream.messages import Pair
    from streamxm.tools.datasets import iter_pairs, load_dataset
    from streamxm.tools.push import PushStopped, push_pairs

    # Arguments first: a wrong path must not start the embedded Redis.
    ds = load_dataset(args.dataset)
    pairs = list(
        iter_pairs(ds, limit=args.limit, unlabelled=args.unlabelled, prefix=args.id_prefix)
    )
    send: Callable[[Sequence[Pair]], list[str]]
    if args.url:
        from streamxm.client import Client

        token = args.token or os.environ.get("STREAMXM_API_TOKEN") or None
        send = Client(args.url, token=token).push
    else:
        from streamxm.service import limits_from
        from streamxm.stream.producer import StreamProducer
        from streamxm.stream.redis_conn import Replication, connect

        settings = get_settings()
        send = StreamProducer(
            connect(settings),
            settings.namespace,
            limits_from(settings),
            replication=Replication.of(settings),
        ).push_pairs
    try:
        report = push_pairs(pairs, send, start=args.start, rate=args.rate)
    except PushStopped as stopped:
        print(f"streamxm push: error: {stopped}", file=sys.stderr)
        return 3 if stopped.transient else 2
    print(report.summary())
    return 0


def _print_bench(result: dict[str, Any], indent: int | None = None) -> None:
    """Print a benchmark's result as JSON, with the ``machine`` it ran on
    (:func:`streamxm.tools.machine.machine`): every ``streamxm bench`` prints its JSON here."""
    from streamxm.tools.machine import with_machine

    print(json.dumps(with_machine(result), indent=indent))


def _cmd_bench_quality(args: argparse.Namespace) -> int:
    from streamxm.tools.bench import quality

    result = quality(**_options(args), progress=not args.json)
    if args.json:
        _print_bench(result)
        return 0
    for name, run in (*result.get("members", {}).items(), (args.model, result)):
        print(
            f"{name} ({args.protocol}): image->text {run['map_i2t']:.4f}  "
            f"text->image {run['map_t2i']:.4f}"
        )
    return 0


def _burst_run(text: str) -> tuple[int, int]:
    """An argparse type: ``LOW,HIGH``, the lengths of the ``bursts`` order's topic bursts."""
    try:
        low, high = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be LOW,HIGH (integers), got {text!r}") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"must have 1 <= LOW <= HIGH, got {text!r}")
    return low, high


def _cmd_bench_order(args: argparse.Namespace) -> int:
    from streamxm.tools.bench import BENCH_ORDERS, stream_order

    models = args.model or list(MODEL_NAMES)
    seeds = [args.seed] if args.seed is not None else _seeds(args.seeds)
    result = stream_order(
        args.dataset,
        models,
        seeds=seeds,
        label_noise=args.label_noise,
        progress=not args.json,
        orders=args.order or BENCH_ORDERS,
        burst_run=args.burst_run,
        params=parse_params(args.param) or None,
    )
    if args.json:
        _print_bench(result)
        return 0
    print(
        f"seeds {','.join(map(str, seeds))}: means over seeds, image->text / text->image, and "
        f"their share of file order; bars: {', '.join(result['orders'])} >= "
        f"{result['order_share']:.0%}, with {result['label_noise']:.0%} wrong labels >= "
        f"{result['noise_share']:.0%} (bursts of {result['burst_run'][0]}-"
        f"{result['burst_run'][1]} pairs)"
    )
    for row in result["models"]:
        f = row["file"]
        parts = [
            f"file {f['mean']['map_i2t']:.4f} / {f['mean']['map_t2i']:.4f}"
            f" (sd {f['std']['map_i2t']:.4f} / {f['std']['map_t2i']:.4f})"
        ]
        for name in (*result["orders"], "noisy"):
            run, share = row[name], row["shares"].get(name)
            if run is None or share is None:
                parts.append(f"{name} (reads no label)")
                continue
            parts.append(
                f"{name} {run['mean']['map_i2t']:.4f} / {run['mean']['map_t2i']:.4f}"
                f" ({share['map_i2t']:.1%} / {share['map_t2i']:.1%})"
            )
        failed = [name for name, ok in row["checks"].items() if not ok]
        print(
            f"{row['model']:<20} {'  '.join(parts)}  "
            f"{'met' if not failed else 'missed: ' + ', '.join(failed)}"
        )
    return 0


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--seeds: comma-separated integers, got {text!r}") from None
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds: {text!r} repeats a seed")
    return seeds


def _cmd_bench_database(args: argparse.Namespace) -> int:
    from streamxm.tools.bench import database_split

    seeds = _seeds(args.seeds)
    result = database_split(**_options(args, "seeds"), seeds=seeds, progress=not args.json)
    if args.json:
        _print_bench(result)
    else:
        print(
            f"{args.model} ({len(seeds)} splits): "
            + "  ".join(
                f"{k[4:]} {v:.4f}+-{result['std'][k]:.4f}" for k, v in result["mean"].items()
            )
        )
    return 0


def _cmd_bench_throughput(args: argparse.Namespace) -> int:
    from streamxm.tools.throughput import throughput

    result = throughput(**_options(args))
    if args.json:
        _print_bench(result)
    else:
        line = f"{args.model}: {result['pairs_per_s']:.0f} pairs/s on one core"
        if "limit_pairs_per_s" in result:
            line += (
                f", machine limit {result['limit_pairs_per_s']:.0f} "
                f"(ratio {result['ratio_to_limit']:.2f}), paper loop "
                f"{result['baseline_pairs_per_s']:.0f}"
            )
        if "slowdown" in result:
            line += (
                f"; the same pairs in their own order {result['file_order_pairs_per_s']:.0f}"
                f" ({result['slowdown']:.2f}x the time per pair in {args.order} order)"
            )
        if "evaluation_share" in result:
            line += (
                f"; with the rolling evaluation every {result['evaluated_every']} pairs, "
                f"{result['evaluation_share']:.0%} of the time (learning alone "
                f"{result['learning_only_pairs_per_s']:.0f} pairs/s)"
            )
        if "roofline_pairs_per_s" in result:
            line += (
                f"; roofline {result['roofline_pairs_per_s']:.0f} pairs/s "
                f"({result['roofline_bound']}-bound, ratio {result['ratio_to_roofline']:.2f})"
            )
        print(line)
    return 0


def _cmd_bench_load(args: argparse.Namespace) -> int:
    import importlib

    bench = _LOAD_BENCHES[args.bench]
    result = getattr(importlib.import_module(f"streamxm.tools.{bench.module}"), bench.function)(
        **_options(args)
    )
    _print_bench(result, indent=None if args.json else 2)
    return 0


def _cmd_bench_distributed(args: argparse.Namespace) -> int:
    from streamxm.tools.bench_ranks import distributed

    ranks = tuple(int(x) for x in args.ranks.split(","))
    result = distributed(**_options(args, "ranks"), ranks=ranks)
    _print_bench(result, indent=None if args.json else 2)
    return 0


def _cmd_redis(args: argparse.Namespace) -> int:
    from streamxm.config import get_settings
    from streamxm.stream.redis_conn import EmbeddedRedis

    settings = get_settings()
    server = EmbeddedRedis(settings.data_dir / "redis", settings.redis_appendfsync)
    if args.action == "start":
        # On purpose: it keeps running when the workers and APIs that use it exit.
        print(server.start(pin=True))
    elif args.action == "stop":
        # Say what happened: the embedded server outlives the workers and APIs that used it.
        if server.is_running():
            server.stop()
            print(
                f"stopped the embedded Redis at {server.url} (its data stays in {server.data_dir})"
            )
        else:
            print(f"the embedded Redis at {server.url} was not running")
    else:
        users = server.live_users()
        print(
            "running" if server.is_running() else "stopped",
            server.url,
            "(started with `streamxm redis start`)"
            if server.pinned.exists()
            else f"(used by {len(users)} streamxm process(es))",
        )
    return 0


#: The ``add_subparsers`` action a command's builder adds its parser to.
_Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

#: ``--json``'s help where a benchmark prints indented JSON without it.
_ONE_LINE_JSON = "one line of JSON (default indented)"


def _add_dataset(parser: argparse.ArgumentParser) -> None:
    """``--dataset``, required: a benchmark file or a bundled one."""
    parser.add_argument("--dataset", required=True, help=DATASET_HELP)


def _add_model_name(parser: argparse.ArgumentParser) -> None:
    """``--model``, required: a known model name, checked before anything starts."""
    parser.add_argument(
        "--model", required=True, type=_model_name, help="model name: " + ", ".join(MODEL_NAMES)
    )


def _add_param(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    """``--param KEY=VALUE``, repeatable: model parameters (:func:`parse_params`)."""
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help=help)


def _add_param_and_json(parser: argparse.ArgumentParser) -> None:
    """``--param`` and ``--json``: a learning benchmark's last two options."""
    _add_param(parser)
    parser.add_argument("--json", action="store_true")


def _add_dims(parser: argparse.ArgumentParser, img_dim: int, txt_dim: int) -> None:
    """``--img-dim`` and ``--txt-dim``: the sizes of a benchmark's synthetic pairs."""
    parser.add_argument("--img-dim", type=int, default=img_dim)
    parser.add_argument("--txt-dim", type=int, default=txt_dim)


def _add_optional_int(parser: argparse.ArgumentParser, flag: str, metavar: str, help: str) -> None:
    """An integer option that is None when not given (the command then picks)."""
    parser.add_argument(flag, type=int, default=None, metavar=metavar, help=help)


def _add_eval_every(
    parser: argparse.ArgumentParser, default: int | str | None, help: str | None = None
) -> None:
    """``--eval-every N|auto``: the rolling evaluation's schedule."""
    parser.add_argument(
        "--eval-every", type=_eval_every, default=default, metavar="N|auto", help=help
    )


def _add_label_noise(parser: argparse.ArgumentParser, default: float, help: str) -> None:
    """``--label-noise P``: a fraction of the training labels replaced by another class."""
    parser.add_argument("--label-noise", type=_fraction, default=default, metavar="P", help=help)


def _add_seed_and_json(parser: argparse.ArgumentParser, json_help: str | None = None) -> None:
    """``--seed`` (default 0) and ``--json``, a benchmark's last two options."""
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help=json_help)


def _demo_command(sub: _Commands) -> None:
    demo = sub.add_parser("demo", help="embedded Redis + worker + API on the Wikipedia pairs")
    demo.add_argument("--pairs", type=int, default=None, help="train pairs to replay (default all)")
    demo.add_argument("--json", action="store_true", help="print the final figures as JSON")
    demo.add_argument("--port", type=int, default=8765, help="API port for the demo")
    demo.add_argument("--rate", type=float, default=None, help="push rate, pairs/s")
    demo.add_argument("--model", default="cmos")
    demo.set_defaults(func=_cmd_demo)


def _worker_command(sub: _Commands) -> None:
    worker = sub.add_parser("worker", help="run a learner worker")
    _add_model_name(worker)
    _add_param(worker, help="model parameter for a fresh model (JSON value)")
    _add_optional_int(
        worker,
        "--world-size",
        "N",
        "ranks learning this model together (default: $WORLD_SIZE or 1)",
    )
    _add_optional_int(
        worker,
        "--rank",
        "R",
        "this process's rank, 0 to N-1; rank 0 reads, checkpoints and "
        "acknowledges (default: $RANK or 0)",
    )
    worker.set_defaults(func=_cmd_worker)


def _service_commands(sub: _Commands) -> None:
    """The service's processes: demo, worker, indexer, api."""
    _demo_command(sub)
    _worker_command(sub)
    indexer = sub.add_parser(
        "indexer",
        help="keep the search gallery as segments API replicas "
        "open instead of replaying the stream (one active per namespace)",
    )
    indexer.set_defaults(func=_cmd_indexer)

    api = sub.add_parser("api", help="run the HTTP API")
    api.add_argument("--host", default=None)
    api.add_argument("--port", type=int, default=None)
    api.set_defaults(func=_cmd_api)


def _push_command(sub: _Commands) -> None:
    push = sub.add_parser("push", help="push a dataset's training pairs into the stream")
    _add_dataset(push)
    push.add_argument("--rate", type=float, default=None, help="pairs per second")
    push.add_argument("--limit", type=int, default=None, help="push only the first N pairs")
    push.add_argument("--unlabelled", action="store_true", help="withhold labels")
    push.add_argument("--id-prefix", default="train", help="pair ids are PREFIX-<row>")
    push.add_argument(
        "--start",
        type=int,
        default=0,
        help="skip the first N pairs: resume "
        "a push that stopped after N had landed (its error says N)",
    )
    push.add_argument(
        "--url",
        default=None,
        help="push through the HTTP API at this URL "
        "(streamxm.client) instead of straight into Redis",
    )
    push.add_argument(
        "--token",
        default=None,
        help="with --url: the API's bearer token (default: STREAMXM_API_TOKEN)",
    )
    push.set_defaults(func=_cmd_push)


def _operator_commands(sub: _Commands) -> None:
    """What an operator runs beside the service: report, top, rollback, migrate-keys, push,
    redis."""
    rep = sub.add_parser("report", help="stream-protocol plots and a summary table for models")
    _add_dataset(rep)
    rep.add_argument("--models", required=True, help="comma-separated model names")
    rep.add_argument("--out", required=True, help="directory for the PNGs and the summary")
    rep.add_argument("--seed", type=int, default=0)
    rep.add_argument("--every", type=int, default=256, help="evaluate every N pairs")
    _add_param(rep)
    rep.set_defaults(func=_cmd_report)

    top = sub.add_parser("top", help="live health view read from the API's /metrics")
    top.add_argument("--url", default=None, help="API base URL (default: the settings' host/port)")
    top.add_argument("--interval", type=float, default=2.0, help="seconds between frames")
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    top.set_defaults(func=_cmd_top)

    rb = sub.add_parser(
        "rollback",
        help="make a kept checkpoint version the served one and the "
        "one its learner continues from (the stream after it is replayed)",
    )
    _add_model_name(rb)
    _add_optional_int(
        rb,
        "--to",
        "VERSION",
        "kept version to go back to; without it, list the kept versions and "
        "the model's past rollbacks",
    )
    rb.set_defaults(func=_cmd_rollback)

    mk = sub.add_parser(
        "migrate-keys",
        help="rename a namespace's keys from sxm:<ns>:... to "
        "the hash-tagged sxm:{<ns>}:... (once, on the single server, with the "
        "namespace's workers and APIs stopped)",
    )
    mk.add_argument("--namespace", default=None, help="default: STREAMXM_NAMESPACE")
    mk.add_argument("--dry-run", action="store_true", help="list what would be renamed")
    mk.set_defaults(func=_cmd_migrate_keys)

    _push_command(sub)

    rd = sub.add_parser("redis", help="the embedded Redis server")
    rd.add_argument("action", choices=["start", "stop", "status"])
    rd.set_defaults(func=_cmd_redis)


def _bench_quality_options(parser: argparse.ArgumentParser) -> None:
    _add_dataset(parser)
    parser.add_argument(
        "--model",
        required=True,
        help="a model, or ensemble:<a>+<b>... (each member trained and scored too)",
    )
    parser.add_argument("--protocol", choices=["stream", "offline"], default="stream")
    parser.add_argument("--unlabelled", action="store_true", help="withhold every training label")
    parser.add_argument(
        "--order",
        choices=ORDERS,
        default="file",
        help="training pairs in file order, sorted by class (bursts of one topic), "
        "shuffled, in topic bursts of 30-100 pairs (bursts), or one class at a time with "
        "the classes in a random order (class-shuffled); seeded",
    )
    _add_label_noise(
        parser, 0.0, "replace a fraction P of training labels by another class (seeded)"
    )
    parser.add_argument(
        "--buffer-memory",
        type=int,
        default=None,
        metavar="SLOTS",
        help="slots of a class-balanced memory of the whole history beside the 500 "
        "recent pairs, drawn from during bursts of few classes (default: the "
        "model's own: 500 for cmos, cmomks and pairwise, 1000 for "
        "pairwise:marginal, 0 for the others)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=5, help="passes for --protocol offline")
    _add_eval_every(
        parser,
        1,
        help="the rolling evaluation's schedule while it learns (the service's "
        "default: auto): rolling_map and its standard error in the JSON",
    )


def _bench_order_options(parser: argparse.ArgumentParser) -> None:
    _add_dataset(parser)
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="MODEL",
        type=_model_name,
        help="a model to try (repeatable; default: every model)",
    )
    parser.add_argument(
        "--seeds",
        default="0",
        help="comma-separated seeds (e.g. 0,1,2,3,4): the figures are means and spreads over them",
    )
    parser.add_argument("--seed", type=int, default=None, help="one seed (same as --seeds N)")
    _add_label_noise(
        parser, 0.2, "fraction of training labels replaced by another class in the noisy run"
    )
    parser.add_argument(
        "--order",
        action="append",
        default=[],
        choices=[o for o in ORDERS if o != "file"],
        metavar="ORDER",
        help="an order to run beside file order (repeatable; default: class, bursts, "
        "class-shuffled; also shuffled)",
    )
    parser.add_argument(
        "--burst-run",
        type=_burst_run,
        default=BURST_RUN,
        metavar="LOW,HIGH",
        help="lengths of the bursts order's topic bursts, in pairs, both included "
        "(default: 30,100)",
    )


def _bench_database_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--seeds", default="0,1,2,3,4", help="one random split per seed")
    parser.add_argument("--query-fraction", type=float, default=0.25)
    parser.add_argument("--protocol", choices=["stream", "offline"], default="offline")
    parser.add_argument("--epochs", type=int, default=5, help="passes for --protocol offline")


def _bench_throughput_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="cmos")
    _add_dims(parser, 4096, 1000)
    parser.add_argument("--pairs", type=int, default=2000, help="timed pairs per repeat")
    parser.add_argument(
        "--baseline-pairs",
        type=int,
        default=200,
        help="timed pairs of the literal paper loop (it is slow)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="figures are medians over repeats")
    parser.add_argument("--seed", type=int, default=0)
    _add_eval_every(
        parser,
        None,
        help="time it with the rolling evaluation scoring every N-th pair (auto: "
        "the service's default STREAMXM_EVAL_EVERY, sized from the model's cost), "
        "beside it off",
    )
    parser.add_argument(
        "--order",
        choices=["file", "class"],
        default="file",
        help="class: the pairs arrive one class at a time (a burst), timed beside "
        "the same pairs in their own order",
    )


class _LearningBench(NamedTuple):
    """A benchmark of learning: its help, what adds its options, and the function the command
    runs."""

    help: str
    options: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


#: Each learning benchmark by its subcommand, in the order ``streamxm bench --help`` lists them.
_LEARNING_BENCHES = {
    "quality": _LearningBench(
        "test-split mAP on a benchmark file",
        _bench_quality_options,
        _cmd_bench_quality,
    ),
    "order": _LearningBench(
        "each model in file order, one class at a time (classes ascending and in a "
        "random order), in topic bursts and with wrong labels, over seeds, against its own "
        "file-order figure",
        _bench_order_options,
        _cmd_bench_order,
    ),
    "database": _LearningBench(
        "mAP with train+test pooled, random query/database split, database "
        "as training set and gallery (the SDSRL paper's protocol)",
        _bench_database_options,
        _cmd_bench_database,
    ),
    "throughput": _LearningBench(
        "pairs learned per second on one core",
        _bench_throughput_options,
        _cmd_bench_throughput,
    ),
}


def _bench_learning_commands(bench_sub: _Commands) -> None:
    """Benchmarks of learning (:data:`_LEARNING_BENCHES`); each ends with ``--param`` and
    ``--json``."""
    for name, bench in _LEARNING_BENCHES.items():
        parser = bench_sub.add_parser(name, help=bench.help)
        bench.options(parser)
        _add_param_and_json(parser)
        parser.set_defaults(func=bench.run)


def _bench_ingest_options(parser: argparse.ArgumentParser) -> None:
    _add_dims(parser, 4096, 1000)
    parser.add_argument(
        "--pairs",
        type=int,
        default=6000,
        help="pairs per path and repeat "
        "(about 120 MB at 4096/1000: short runs were dominated by the machine's "
        "noise)",
    )
    parser.add_argument("--http-batch", type=int, default=64, help="pairs per POST")
    parser.add_argument(
        "--http-clients",
        type=int,
        default=4,
        help="keep-alive connections posting at once (the HTTP counterpart of "
        "the client's pipeline)",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="instead: a local Redis Cluster (3 masters, 3 replicas), the client "
        "pushing into one namespace on one master, then into three namespaces on "
        "three masters at once (a process each)",
    )


def _bench_end_to_end_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="cmos")
    _add_dims(parser, 4096, 1000)
    parser.add_argument("--backlog", type=int, default=4000)
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        help="push rate for the lag phase (default half the learned rate)",
    )
    parser.add_argument("--seconds", type=float, default=60.0)
    _add_eval_every(parser, "auto")


def _bench_query_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gallery", type=int, default=100_000)
    _add_dims(parser, 512, 128)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--model", default="cmos")
    parser.add_argument(
        "--recall-sample",
        type=int,
        default=200,
        help="answers checked against the exact ranking of their version",
    )
    parser.add_argument(
        "--candidates", type=int, default=100, help="STREAMXM_SEARCH_CANDIDATES of the API"
    )
    parser.add_argument(
        "--no-wait-for-index",
        dest="wait_for_index",
        action="store_false",
        help="STREAMXM_WAIT_FOR_INDEX=false: sam and cmomks serve a version at "
        "once, candidates from the earlier version's index",
    )
    parser.add_argument(
        "--gallery-backend",
        choices=("local", "ray"),
        default="local",
        help="STREAMXM_GALLERY_BACKEND of the API (ray: run under unshare -rn, loopback only)",
    )
    parser.add_argument("--shards", type=int, default=2, help="STREAMXM_GALLERY_SHARDS (ray)")


def _bench_soak_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--rate", type=float, default=100.0, help="pairs pushed per second")
    parser.add_argument("--qps", type=float, default=20.0, help="searches per second")
    parser.add_argument("--gallery-max", type=int, default=20_000)
    parser.add_argument("--sample-seconds", type=float, default=60.0)
    parser.add_argument("--warmup-minutes", type=float, default=5.0)


def _bench_hostile_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="1,4,24,64", help="body sizes, MiB, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--probes", type=int, default=200, help="/healthz probes at rest")
    parser.add_argument(
        "--labels-mib",
        type=float,
        default=11.5,
        help="size of the labels bomb: "
        "one frame whose labels field is this many MiB, to /v1/pairs/frames",
    )
    parser.add_argument(
        "--part",
        choices=("all", "server", "client"),
        default="all",
        help="server: junk bodies to the API; client: the Python client against a "
        "malicious server (oversized, gzip-bombed and malformed answers)",
    )
    parser.add_argument(
        "--client-gib",
        type=float,
        default=1.0,
        help="size of the client cases' oversized bodies, GiB",
    )


def _bench_scan_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dims", default="128,512", help="two dimensions, comma-separated")
    parser.add_argument("--queries", type=int, default=32)
    parser.add_argument("--candidates", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)


def _bench_ensemble_recall_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="ensemble:cmos+sdsrl")
    parser.add_argument("--gallery", type=int, default=20_000)
    _add_dims(parser, 128, 32)
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--candidates", type=int, default=100, help="candidates per member")


def _bench_version_cost_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gallery", type=int, default=100_000)
    _add_dims(parser, 512, 128)
    parser.add_argument("--models", default=",".join(MODEL_NAMES), help="comma-separated")
    parser.add_argument("--pairs", type=int, default=1500, help="pairs each model learns first")
    parser.add_argument("--versions", type=int, default=3, help="builds timed per model")
    parser.add_argument(
        "--pairs-between", type=int, default=20, help="pairs learned before each later version"
    )


class _ServiceBench(NamedTuple):
    """A benchmark of the running service: the function it runs (its module in
    ``streamxm.tools`` and its name), its help, and what adds its options."""

    module: str
    function: str
    help: str
    options: Callable[[argparse.ArgumentParser], None]


#: Each service benchmark by its subcommand, in the order ``streamxm bench --help`` lists them.
_LOAD_BENCHES = {
    "ingest": _ServiceBench(
        "bench_ingest",
        "ingest",
        "pairs/s via the client and POST /v1/pairs beside "
        "redis-benchmark's XADD on the same server",
        _bench_ingest_options,
    ),
    "end-to-end": _ServiceBench(
        "bench_end_to_end",
        "end_to_end",
        "pairs/s one worker learns from the stream, "
        "beside the in-process learner; lag at a push rate",
        _bench_end_to_end_options,
    ),
    "query": _ServiceBench(
        "bench_query",
        "query",
        "/v1/search latency under concurrent clients while a worker learns and checkpoints swap in",
        _bench_query_options,
    ),
    "soak": _ServiceBench(
        "bench_soak",
        "soak",
        "long push/learn/query run sampling resident memory",
        _bench_soak_options,
    ),
    "hostile": _ServiceBench(
        "bench_hostile",
        "hostile",
        "junk bodies of growing size and a labels bomb: "
        "answer size, API memory and /healthz latency meanwhile, beside "
        "it at rest",
        _bench_hostile_options,
    ),
    "scan": _ServiceBench(
        "scan",
        "scan",
        "the search candidate scan's backends side by side "
        "(float32, bfloat16, int8, FAISS when installed), one thread",
        _bench_scan_options,
    ),
    "ensemble-recall": _ServiceBench(
        "bench_query",
        "ensemble_recall",
        "recall@k of an ensemble's search (each "
        "member's candidates, fused exactly) against its exact fused "
        "ranking of the whole gallery",
        _bench_ensemble_recall_options,
    ),
    "version-cost": _ServiceBench(
        "bench_version_cost",
        "version_cost",
        "what a new model version costs a search "
        "server: seconds to embed the whole gallery, memory of its kept "
        "features and embeddings, per model",
        _bench_version_cost_options,
    ),
}


def _bench_service_commands(bench_sub: _Commands) -> None:
    """Benchmarks of the running service (:data:`_LOAD_BENCHES`); each ends with ``--seed`` and
    ``--json`` and runs through :func:`_cmd_bench_load`."""
    for name, bench in _LOAD_BENCHES.items():
        parser = bench_sub.add_parser(name, help=bench.help)
        bench.options(parser)
        _add_seed_and_json(parser, _ONE_LINE_JSON)
        parser.set_defaults(func=_cmd_bench_load)


def _bench_distributed_command(bench_sub: _Commands) -> None:
    """``bench distributed``: one model learned by several ranks."""
    di = bench_sub.add_parser(
        "distributed",
        help="pairs/s of one model learned by 1, 2, ... "
        "ranks (streamxm worker --world-size N) from the same backlog, "
        "with the time per round in the collective; test mAP with "
        "--dataset",
    )
    di.add_argument("--model", default="cmos")
    di.add_argument("--ranks", default="1,2", help="rank counts, comma-separated")
    _add_dims(di, 4096, 1000)
    di.add_argument(
        "--pairs",
        type=int,
        default=12288,
        help="synthetic pairs, or the first N training pairs of --dataset (0: all)",
    )
    di.add_argument("--threads-per-rank", type=int, default=1)
    di.add_argument("--read-batch", type=int, default=256, help="pairs per rank per round")
    _add_eval_every(di, "auto")
    di.add_argument(
        "--dataset",
        default=None,
        help="benchmark .npz (or 'wiki'): its training "
        "split in file order instead of synthetic pairs, and test mAP per run",
    )
    _add_param(di)
    _add_seed_and_json(di, _ONE_LINE_JSON)
    di.set_defaults(func=_cmd_bench_distributed)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamxm", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    _service_commands(sub)
    _operator_commands(sub)
    bench = sub.add_parser("bench", help="benchmarks (JSON output)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    _bench_learning_commands(bench_sub)
    _bench_service_commands(bench_sub)
    _bench_distributed_command(bench_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from pydantic import ValidationError
    from redis.exceptions import RedisClusterException, RedisError

    from streamxm.client.errors import StreamxmError, Unavailable
    from streamxm.stream.messages import InvalidPair
    from streamxm.stream.migrate import LegacyKeys, MigrationConflict

    try:
        from streamxm.config import get_settings
        from streamxm.threads import apply_threads

        apply_threads(get_settings().threads)  # before any pool spins up
        return int(args.func(args))
    except ValidationError as exc:  # the settings: name each variable that is wrong
        for error in exc.errors():
            name = "STREAMXM_" + "_".join(str(x) for x in error["loc"]).upper()
            print(f"streamxm {args.command}: error: {name}: {error['msg']}", file=sys.stderr)
        return 2
    except (
        FileNotFoundError,
        InvalidPair,
        ValueError,
        TimeoutError,
        LegacyKeys,
        MigrationConflict,
    ) as exc:
        print(f"streamxm {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except StreamxmError as exc:  # the HTTP client's: the server's answer, or none
        print(f"streamxm {args.command}: error: {exc}", file=sys.stderr)
        return 3 if isinstance(exc, Unavailable) else 2
    except (RedisError, RedisClusterException) as exc:  # NotReplicated, a lost connection
        print(f"streamxm {args.command}: Redis error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 130
