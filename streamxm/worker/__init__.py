"""The learner worker: consumer loop, lease, checkpoints, fail points."""
