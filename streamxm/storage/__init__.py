"""What the worker, the indexer and the API share in the store: checkpoint blobs and their
stores (Redis or a directory), and the search gallery's segments."""
