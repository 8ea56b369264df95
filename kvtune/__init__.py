"""kvtune: deploy and tune vLLM engines (KV budget, prefix caching, fp8 KV cache) against a latency SLO."""

__version__ = "0.1.0"
