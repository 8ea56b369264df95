"""A "TTFT / ITL" tab in Locust's web UI (its extended-tab mechanism), with a CSV download of the rows.

The listener is registered when this module is imported (every Locust file imports it through
kvtune.loadgen.locust_user), before Locust fires its `init` event with the web UI.
"""

from __future__ import annotations

import json
from typing import Any

from flask import Response, request
from locust import events
from locust.env import Environment

from kvtune.loadgen.locust_token_stats import TOKEN_COLUMNS, TOKEN_STATS, token_csv, token_rows

LATENCY_TAB = "token-latency"
LATENCY_CSV_ROUTE = "/kvtune/token-latency.csv"


@events.init.add_listener
def _token_latency_tab(environment: Environment, web_ui: Any = None, **_kwargs: Any) -> None:
    if web_ui is None:
        return
    web_ui.template_args.update(
        extended_tabs=[{"title": "TTFT / ITL", "key": LATENCY_TAB}],
        extended_tables=[
            {"key": LATENCY_TAB, "structure": [{"key": k, "title": t} for k, t in TOKEN_COLUMNS.items()]}
        ],
        extended_csv_files=[{"href": f".{LATENCY_CSV_ROUTE}", "title": "Download TTFT / ITL CSV"}],
    )

    @web_ui.app.after_request
    def _with_token_stats(response: Response) -> Response:
        # The UI polls /stats/requests; its extended tab reads the rows from the same answer.
        if request.path.endswith("/stats/requests") and response.is_json:
            payload = response.get_json() | {
                "extended_stats": [{"key": LATENCY_TAB, "data": token_rows(TOKEN_STATS)}]
            }
            response.set_data(json.dumps(payload))
        return response

    @web_ui.app.route(LATENCY_CSV_ROUTE)
    def _token_latency_csv() -> Response:
        disposition = "attachment; filename=token_latency.csv"
        return Response(
            token_csv(TOKEN_STATS), mimetype="text/csv", headers={"Content-Disposition": disposition}
        )
