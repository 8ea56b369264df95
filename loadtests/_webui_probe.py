"""Probe locustfile for the browser smoke test: one HTTP GET plus custom TTFT/ITL request events."""

from __future__ import annotations

import random

from locust import HttpUser, constant, task


class ProbeUser(HttpUser):
    wait_time = constant(0.2)

    @task
    def probe(self) -> None:
        self.client.get("/", name="root")
        # Streaming metrics are reported as their own request types, like a real LLM locustfile would.
        for request_type, milliseconds in (("TTFT", random.uniform(20, 40)), ("ITL", random.uniform(2, 6))):
            self.environment.events.request.fire(
                request_type=request_type,
                name="probe",
                response_time=milliseconds,
                response_length=0,
                exception=None,
                context={},
            )


if __name__ == "__main__":
    from locust import run_single_user

    run_single_user(ProbeUser)
