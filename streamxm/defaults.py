"""Every default the service's parts share, in one place: the settings (``streamxm.config``)
and the constructors of the worker, the indexer and the server take them from here, so a
default is changed once."""

from __future__ import annotations

from typing import Final

# The learner worker
CHECKPOINT_EVERY_PAIRS = 2000
CHECKPOINT_EVERY_SECONDS = 2.0
# Checkpoints take at most this share of a worker's time: the next one waits for it.
CHECKPOINT_MAX_SHARE = 0.1
# Scheduled checkpoints are written by a thread while learning goes on.
CHECKPOINT_IN_BACKGROUND = True
CHECKPOINT_KEEP = 3
READ_BATCH = 256  # XREADGROUP COUNT
BLOCK_MS = 200  # XREADGROUP BLOCK
LEASE_TTL_MS = 10_000
# While it leads, a worker logs one progress line this often (seconds), as queue workers do;
# 0: never.
PROGRESS_EVERY_SECONDS = 10.0

# The gallery: its cap, the indexer's segments, the API's reads of the stream
GALLERY_MAX = 100_000
#: Parts of the item space the gallery indexer cuts its segments along (1: one part).
GALLERY_PARTS = 1
INDEXER_FLUSH_SECONDS = 2.0
INDEXER_SEGMENT_ROWS = 16_384
INDEXER_READ_BATCH = 2000
GALLERY_READ_COUNT = 5000

# Search
SEARCH_CANDIDATES = 100
#: A model that embeds raw vectors (sam, cmomks) serves a new version only once that version has
#: embedded the gallery (True: exact answers), or at once, its candidates from the newest embedded
#: index (False: fresher versions, approximate answers; docs/benchmarks.md measures both).
WAIT_FOR_INDEX = True

# The rolling evaluation (streamxm.learning.schedule): "auto" scores every N-th pair, N sized so
# that the counted evaluation work is at most EVAL_SHARE of the counted learning work, both
# timed at one thread's rates of the reference machine (float64 GEMM, a streaming read of
# float32 state); fixed numbers, not measured, so every learner picks the same N.
EVAL_EVERY: Final = "auto"
EVAL_SHARE = 0.05
REFERENCE_FLOPS_PER_S = 73e9
REFERENCE_BYTES_PER_S = 27e9
