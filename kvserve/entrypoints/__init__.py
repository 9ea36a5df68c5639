"""Entry points: the ``kvserve`` command line."""
