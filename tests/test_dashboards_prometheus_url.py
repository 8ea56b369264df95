"""`kvtune dashboards push --prometheus-url URL`: Grafana stores the URL as written and shows it to every
viewer of the data source, so only an http(s) base URL with a host is taken, and none with a user or password
(in any position); each refusal is one line before Grafana is asked anything, the password never shown."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtune import cli
from tests.hostile_servers import HostileServer, hostile_server

__all__ = ["hostile_server"]  # the fixture, imported for pytest

SECRET = "hunter2-datasource-secret"
TOKEN_ENV = "KVTUNE_TEST_GRAFANA_TOKEN"


def push(capsys: pytest.CaptureFixture[str], grafana: str, prometheus_url: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(
        ["dashboards", "push", "--url", grafana, "--token-env", TOKEN_ENV, "--prometheus-url", prometheus_url]
    )
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, " ".join(err.split())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    url=st.one_of(
        st.sampled_from(
            ["javascript:alert(1)", "file:///etc/passwd", "ftp://h:21", "data:,x", "//h:9090", "h:9090"]
        ),
        st.sampled_from(
            [
                f"http://u:{SECRET}@127.0.0.1:9090",
                f"https://{SECRET}@prometheus:9090/prom",
                f"http://127.0.0.1:9090/?password={SECRET}",
                f"http://127.0.0.1:9090/#{SECRET}",
                f"http://u:{SECRET}@127.0.0.1:99999",
            ]
        ),
    )
)
def test_only_an_http_base_url_without_credentials_becomes_a_data_source(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    hostile_server: HostileServer,
    url: str,
) -> None:
    monkeypatch.setenv(TOKEN_ENV, "glsa_test_token")
    code, out, err = push(capsys, hostile_server.url, url)
    assert code == 2 and out == "", err
    assert err.startswith("error: --prometheus-url ") and SECRET not in out + err, err
    assert hostile_server.requests == []  # refused before Grafana was asked anything


def test_an_http_base_url_goes_on_to_grafana(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, hostile_server: HostileServer
) -> None:
    monkeypatch.setenv(TOKEN_ENV, "glsa_test_token")
    _, _, err = push(capsys, hostile_server.url, "http://127.0.0.1:9090/")
    assert "--prometheus-url" not in err
    assert hostile_server.requests, "Grafana was never asked"
