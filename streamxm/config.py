"""Settings, read from ``STREAMXM_*`` environment variables or a ``.env`` file.

Every setting is documented in the README; the names there are the field names upper-cased with
the ``STREAMXM_`` prefix (``redis_url`` -> ``STREAMXM_REDIS_URL``).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Service settings with production defaults."""

    model_config = SettingsConfigDict(env_prefix="STREAMXM_", env_file=".env", extra="ignore")

    redis_url: str | None = Field(
        default=None, description="Redis >= 6.2 URL; unset starts the embedded server"
    )
    data_dir: Path = Field(default=Path(".streamxm"),
                           description="embedded Redis data and local files")
    namespace: str = Field(default="default", pattern=r"^[A-Za-z0-9_.-]{1,64}$")

    # Learner worker
    checkpoint_store: Literal["redis", "dir"] = "redis"
    checkpoint_dir: Path = Path(".streamxm/checkpoints")
    checkpoint_every_pairs: int = Field(default=2000, ge=1)
    checkpoint_every_seconds: float = Field(default=2.0, gt=0)
    checkpoint_keep: int = Field(default=3, ge=1)
    read_batch: int = Field(default=256, ge=1, le=10_000)
    block_ms: int = Field(default=200, ge=1)
    lease_ttl_ms: int = Field(default=10_000, ge=100)
    consumer: str | None = Field(default=None, description="consumer name; default host-pid")
    seed: int = 0
    buffer_capacity: int = Field(default=500, ge=2, le=1_000_000,
                                 description="replay buffer of recent pairs (triplet sampling)")
    eval_every: int = Field(default=1, ge=1,
                            description="score every N-th pair for the rolling mAP (test-then-"
                                        "train); raise it for large vectors")

    # API
    api_host: str = "127.0.0.1"
    api_port: int = 8000
    api_token: SecretStr | None = None
    api_token_for_reads: bool = False
    default_model: str = "cmos"
    gallery_max: int = Field(default=100_000, ge=1)
    reload_interval_seconds: float = Field(default=0.25, gt=0)

    # Input bounds: one request or message cannot exhaust memory.
    max_dim: int = Field(default=65_536, ge=1)
    max_labels: int = Field(default=64, ge=1)
    max_label_value: int = Field(default=1_000_000, ge=1)
    max_id_length: int = Field(default=256, ge=1)
    max_batch: int = Field(default=1024, ge=1)
    max_k: int = Field(default=1000, ge=1)
    max_body_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings (read once)."""
    return Settings()
