"""Settings, read from ``STREAMXM_*`` environment variables or a ``.env`` file.

Every setting is documented in ``docs/settings.md``; the names there are the field names
upper-cased with the ``STREAMXM_`` prefix (``redis_url`` -> ``STREAMXM_REDIS_URL``).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from streamxm import defaults as D

# Ceilings of the input bounds: the request schemas declare them, the settings may only lower.
MAX_DIM_CEILING = 65_536
MAX_BATCH_CEILING = 4096
MAX_K_CEILING = 10_000
MAX_LABELS_CEILING = 1024
MAX_REQUEST_VALUES_CEILING = 1 << 24
#: Bytes of JSON per vector value a legitimate client needs at most: a float32 printed with
#: every digit of its float64 repr (``-0.00012345678901234567``) plus a separator.
JSON_BYTES_PER_VALUE = 24


class Settings(BaseSettings):
    """Service settings with production defaults."""

    model_config = SettingsConfigDict(env_prefix="STREAMXM_", env_file=".env", extra="ignore")

    redis_url: str | None = Field(
        default=None, description="Redis >= 6.2 URL; unset starts the embedded server"
    )
    data_dir: Path = Field(
        default=Path(".streamxm"), description="embedded Redis data and local files"
    )
    namespace: str = Field(default="default", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    threads: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="threads of every numeric "
        "pool in each process (BLAS, OpenMP, PyTorch): processes share a "
        "machine, so one each unless a process has the machine to itself",
    )
    redis_appendfsync: Literal["everysec", "always"] = Field(
        default="everysec",
        description="the embedded Redis's AOF fsync policy, fixed when it starts: "
        "'everysec' can lose the last acknowledged writes of a killed server when a slow disk "
        "made Redis postpone its AOF write (up to 2 s); 'always' loses none, at a lower push "
        "rate (an fsync per event-loop turn)",
    )
    redis_wait_replicas: int = Field(
        default=0,
        ge=0,
        le=16,
        description="replicas that must hold a push or a checkpoint "
        "commit before it counts as done (Redis WAIT); 0: replication is asynchronous",
    )
    redis_wait_timeout_ms: int = Field(
        default=1000,
        ge=1,
        description="how long a push or a commit waits for those replicas before it fails",
    )

    # Learner worker
    checkpoint_store: Literal["redis", "dir"] = "redis"
    checkpoint_dir: Path = Path(".streamxm/checkpoints")
    checkpoint_every_pairs: int = Field(default=D.CHECKPOINT_EVERY_PAIRS, ge=1)
    checkpoint_every_seconds: float = Field(default=D.CHECKPOINT_EVERY_SECONDS, gt=0)
    checkpoint_max_share: float = Field(
        default=D.CHECKPOINT_MAX_SHARE,
        gt=0,
        le=1,
        description="most of a worker's time its "
        "checkpoints may take: after a checkpoint that took c seconds the next waits at least "
        "c (1 - share) / share, whatever the pairs or seconds say (large models checkpoint "
        "less often; 1: no wait)",
    )
    checkpoint_in_background: bool = Field(
        default=D.CHECKPOINT_IN_BACKGROUND,
        description="write scheduled checkpoints from a "
        "thread while the worker learns (from a copy of the state: one more state's memory "
        "while it is written); false: on the learning path",
    )
    checkpoint_keep: int = Field(default=D.CHECKPOINT_KEEP, ge=1)
    read_batch: int = Field(default=D.READ_BATCH, ge=1, le=10_000)
    block_ms: int = Field(default=D.BLOCK_MS, ge=1)
    lease_ttl_ms: int = Field(default=D.LEASE_TTL_MS, ge=100)
    consumer: str | None = Field(default=None, description="consumer name; default host-pid")
    progress_every_seconds: float = Field(
        default=D.PROGRESS_EVERY_SECONDS,
        ge=0,
        description="while it leads, a worker logs one "
        "INFO line this often: pairs learned in total and since the last line, pairs/s, the "
        "newest checkpoint version, mistakes per direction since the last line, the rolling "
        "mAP and the stream lag; one line per idle stretch, then silence. 0: no progress line",
    )
    dist_host: str = Field(
        default="127.0.0.1",
        min_length=1,
        description="address a rank of a distributed "
        "learner binds its collective (gloo) sockets to and the other ranks reach it at; "
        "loopback keeps every rank on one machine. The rendezvous goes through Redis, so no "
        "other port is opened; rank traffic is unencrypted and belongs on a private network",
    )
    dist_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="how long a distributed learner's collective waits "
        "for a rank that hangs before every rank drops its state and reloads (a rank that dies "
        "is noticed at once)",
    )
    seed: int = 0
    buffer_capacity: int = Field(
        default=500,
        ge=2,
        le=1_000_000,
        description="replay buffer of recent pairs (triplet sampling)",
    )
    buffer_memory: int | None = Field(
        default=None,
        ge=0,
        le=1_000_000,
        description="slots of a class-balanced memory of the "
        "whole history beside the buffer of recent pairs, drawn "
        "from during bursts of few classes (a fresh learner); "
        "unset: the model's own (as many as the buffer for cmos, "
        "cmomks and pairwise, twice for pairwise:marginal, none "
        "for the others)",
    )
    eval_every: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        default=D.EVAL_EVERY,
        description="score every N-th pair for the rolling mAP "
        "(test-then-train); auto: N sized from the model's counted work so that scoring costs "
        "about 5% of learning (1 for the slower models, 20-30 for cmos)",
    )

    # API
    api_host: str = "127.0.0.1"
    api_port: int = 8000
    api_token: SecretStr | None = Field(
        default=None,
        description="bearer token for writes (and reads with "
        "api_token_for_reads); unset: no token. Set but empty is refused",
    )
    api_token_for_reads: bool = False
    api_role: Literal["all", "ingest", "query"] = Field(
        default="all",
        description="what this API process serves: all; ingest (the write "
        "routes only: it loads no model and keeps no search gallery, so its CPU goes to the "
        "pairs); query (the read routes only)",
    )
    default_model: str = Field(
        default="auto",
        description="model used when a request names "
        "none; auto: the champion of the query's direction",
    )
    champion_min_pairs: int = Field(
        default=200,
        ge=1,
        description="pairs behind a model's rolling mAP before it can be "
        "the champion that answers model=auto",
    )
    champion_margin: float = Field(
        default=0.005,
        ge=0,
        description="rolling mAP (absolute) by which a challenger must "
        "lead the champion to replace it",
    )
    champion_confirmations: int = Field(
        default=3, ge=1, description="consecutive refreshes the challenger must lead by the margin"
    )
    gallery_max: int = Field(default=D.GALLERY_MAX, ge=1)
    gallery_parts: int = Field(
        default=D.GALLERY_PARTS,
        ge=1,
        le=1024,
        description="parts of the item space the gallery indexer writes its segments by: a "
        "`ray` gallery shard reads only the segments of its own part, so set it to the "
        "shard count (or a multiple); 1: each segment holds every item",
    )
    stream_retention: bool = Field(
        default=True,
        description="workers trim the pairs stream after each checkpoint to "
        "the oldest entry a learner or the gallery (the newest gallery_max entries) still needs",
    )
    search_candidates: int = Field(
        default=D.SEARCH_CANDIDATES,
        ge=1,
        le=10_000,
        description="candidates re-ranked per "
        "search: max(this, 4 k); a fixed-space model's bfloat16 scan proposes at least one "
        "per 2,500 gallery rows",
    )
    wait_for_index: bool = Field(
        default=D.WAIT_FOR_INDEX,
        description="a model that embeds raw vectors (sam, cmomks) "
        "serves a new version once it has embedded the gallery: every answer its exact "
        "ranking, each version seconds late at 100,000 items; false: serve it at once, its "
        "candidates (search_candidates) from the newest embedded index re-ranked by its "
        "exact scores (the answer's index_version names that index; approximate)",
    )
    gallery_backend: Literal["local", "ray"] = Field(
        default="local",
        description="where the API's gallery lives: `local` (this process) or `ray` (shard "
        "actors on a Ray cluster, each holding a part: `pip install 'streamxm[ray]'`)",
    )
    ray_address: str | None = Field(
        default=None,
        description="the Ray cluster the `ray` backend joins (`ray.init(address=...)`); unset "
        "starts one on this machine",
    )
    gallery_shards: int = Field(
        default=2, ge=1, le=1024, description="shard actors of the `ray` gallery backend"
    )
    shard_gpus: float | None = Field(
        default=None,
        ge=0,
        le=64,
        description="GPUs each gallery shard asks Ray for: unset takes an equal share of the "
        "cluster's GPUs (at most one a shard) when it has any, else none; 0 keeps the shards on "
        "CPUs. A shard with a GPU rebuilds sam's towers on it",
    )
    shard_timeout_seconds: float = Field(
        default=5.0,
        gt=0,
        description="how long a search waits for every gallery shard before it answers 503 "
        "(or, when the request asks for it, a partial answer)",
    )
    reload_interval_seconds: float = Field(default=0.25, gt=0)
    query_threads: int = Field(
        default=32,
        ge=1,
        le=256,
        description="threads for similarity and search, apart from "
        "those of routes that wait on Redis",
    )
    redis_request_timeout_seconds: float = Field(
        default=1.0,
        gt=0,
        le=60,
        description="socket timeout of Redis calls made while a "
        "request waits (ingest, /v1/models, the metrics scrape): a stalled Redis gives a 503 "
        "or redis_up 0 in this time, not a hung request",
    )
    metrics_timeout_seconds: float = Field(
        default=0.5,
        gt=0,
        le=10,
        description="a scrape waits this long for fresh stream state, "
        "then answers with the last known values and streamxm_redis_up 0",
    )
    request_read_timeout_seconds: float = Field(
        default=30.0,
        gt=0,
        description="a connection must deliver a request's headers and body "
        "within this time (slow clients are disconnected)",
    )

    # Input bounds: one request or message cannot exhaust memory.
    max_dim: int = Field(default=65_536, ge=1, le=MAX_DIM_CEILING)
    max_labels: int = Field(default=64, ge=1, le=MAX_LABELS_CEILING)
    max_label_value: int = Field(default=1_000_000, ge=1)
    max_id_length: int = Field(default=256, ge=1, le=256)
    max_batch: int = Field(default=1024, ge=1, le=MAX_BATCH_CEILING)
    max_k: int = Field(default=1000, ge=1, le=MAX_K_CEILING)
    max_request_values: int = Field(
        default=1 << 19,
        ge=1,
        le=MAX_REQUEST_VALUES_CEILING,
        description="vector values in one request body, all vectors together",
    )
    max_body_bytes: int = Field(
        default=0,
        ge=0,
        description="request body cap; 0 (default) derives it from "
        "max_request_values: 24 bytes of JSON per value, plus 64 KiB",
    )

    @field_validator("api_token")
    @classmethod
    def _token_not_empty(cls, value: SecretStr | None) -> SecretStr | None:
        # An empty token must not silently turn authentication off.
        if value is not None and not value.get_secret_value().strip():
            raise ValueError(
                "STREAMXM_API_TOKEN is set but empty: set a token, or unset the "
                "variable to run without one"
            )
        return value

    @field_validator("buffer_memory", mode="before")
    @classmethod
    def _memory_blank_is_unset(cls, value: object) -> object:
        # ``STREAMXM_BUFFER_MEMORY=`` (as a compose file writes an optional variable) means the
        # model's own memory, as leaving it out does.
        return None if isinstance(value, str) and not value.strip() else value

    @model_validator(mode="after")
    def _derive_body_limit(self) -> Settings:
        if self.max_body_bytes == 0:
            self.max_body_bytes = JSON_BYTES_PER_VALUE * self.max_request_values + (64 << 10)
        elif self.max_body_bytes < 1024:
            raise ValueError("STREAMXM_MAX_BODY_BYTES must be at least 1024 (or 0: derived)")
        return self


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings (read once)."""
    return Settings()
