"""A Python client for the streamxm HTTP API (:class:`Client`, :class:`AsyncClient`).

>>> from streamxm.client import Client
>>> client = Client("http://127.0.0.1:8000", token=None, timeout=30)
>>> client
Client('http://127.0.0.1:8000')
>>> client.close()
"""

from streamxm.client.aio import AsyncClient
from streamxm.client.calls import (
    Hit,
    ModelInfo,
    Readiness,
    Retries,
    SearchResult,
    ServerLimits,
    SimilarityResult,
)
from streamxm.client.errors import (
    BadResponse,
    InvalidPair,
    InvalidRequest,
    NotFound,
    ResponseTooLarge,
    ServerError,
    StreamxmError,
    Unauthorized,
    Unavailable,
)
from streamxm.client.sync import Client

__all__ = [
    "AsyncClient",
    "BadResponse",
    "Client",
    "Hit",
    "InvalidPair",
    "InvalidRequest",
    "ModelInfo",
    "NotFound",
    "Readiness",
    "ResponseTooLarge",
    "Retries",
    "SearchResult",
    "ServerError",
    "ServerLimits",
    "SimilarityResult",
    "StreamxmError",
    "Unauthorized",
    "Unavailable",
]
