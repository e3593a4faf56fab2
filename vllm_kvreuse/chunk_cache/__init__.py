"""Position-independent chunk cache (issue 5)."""
