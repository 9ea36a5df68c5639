"""Engines: LLMEngine (add_request / abort_request / step) and the offline LLM API."""
