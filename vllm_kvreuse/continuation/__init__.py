"""Continuation requests: a new request inherits a finished request's KV blocks."""
