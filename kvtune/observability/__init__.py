"""Dashboards, alert rules and diagnosis built on vLLM's own metrics."""
