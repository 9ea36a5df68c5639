"""The OpenAI-compatible HTTP server: ``kvserve serve`` (see ``server.py``)."""
