"""The API's routers, one module per concern; :func:`api.app.create_app` includes them."""
