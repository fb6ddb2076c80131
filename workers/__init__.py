"""Learner worker processes (thin entry points; the loop is :mod:`streamxm.worker.loop`)."""
