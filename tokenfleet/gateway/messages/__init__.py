"""Anthropic's Messages API (``routes``) on the same core as chat completions."""
