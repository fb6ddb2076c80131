"""Every default the service's parts share, in one place: the settings (``streamxm.config``)
and the constructors of the worker, the indexer and the server take them from here, so a
default is changed once."""

from __future__ import annotations

# The learner worker
CHECKPOINT_EVERY_PAIRS = 2000
CHECKPOINT_EVERY_SECONDS = 2.0
CHECKPOINT_KEEP = 3
READ_BATCH = 256  # XREADGROUP COUNT
BLOCK_MS = 200  # XREADGROUP BLOCK
LEASE_TTL_MS = 10_000

# The gallery: its cap, the indexer's segments, the API's reads of the stream
GALLERY_MAX = 100_000
INDEXER_FLUSH_SECONDS = 2.0
INDEXER_SEGMENT_ROWS = 16_384
INDEXER_READ_BATCH = 2000
GALLERY_READ_COUNT = 5000

# Search
SEARCH_CANDIDATES = 100
