"""Prefill/decode disaggregation: the KV transfer config, the ZMQ KV connector (both roles) and the proxy.

See docs/disagg.md. ``config`` and ``protocol`` are torch-free; the proxy needs neither torch nor an engine.
"""
