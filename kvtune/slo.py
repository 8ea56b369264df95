"""The latency SLO kvtune assumes when none is given: one home for the alert rules, the chart's values and
`kvtune up --prometheus`, so none of them imports another just to read a number."""

from __future__ import annotations

# P99 time to first token, seconds: what KvtuneTtftP99AboveSlo fires above unless told otherwise.
DEFAULT_TTFT_P99_SLO_S = 2.0
