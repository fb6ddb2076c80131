"""The FastAPI app: thin routes over :mod:`streamxm`."""
