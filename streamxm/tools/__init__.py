"""Tools around the service: benchmarks, load tests, reports, the demo, datasets."""
