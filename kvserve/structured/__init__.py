"""Structured output: constrain generated text to a JSON schema, a regex, a choice or a grammar (xgrammar)."""
