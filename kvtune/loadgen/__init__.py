"""Load generation: KV-cache workloads, streamed TTFT/ITL measurement, Locust integration and its runner."""
