"""Serving: the model server with its gallery, metrics, the HTTP server settings."""
