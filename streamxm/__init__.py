"""streamxm: learn image-text similarity from a live stream and serve it."""

__version__ = "0.1.0"
