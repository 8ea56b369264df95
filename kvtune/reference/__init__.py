"""The documentation site's reference pages (docs/reference/*.md), rendered from the code they describe.

Each page is text derived from one source: the argparse parser (cli), the engine profile and its field facts
(profile_fields), the sweep spec's models (spec_fields), the chart's values schema (chart_values), the metric
names and the queries that read them (metrics), the dashboards and the alert rules (observability).
tools/generate.py alone writes them; `make generate-check` fails when one is stale.
"""
