"""`kvtune sweep`: search vLLM's KV and batching configs under load against a latency SLO."""
