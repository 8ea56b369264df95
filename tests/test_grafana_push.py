"""`kvtune dashboards push|build` and the sweep's trial annotations, against a stand-in of Grafana's HTTP API
(tests/grafana_standin.py): payloads, idempotency, refusals before anything is done, a Grafana failing
mid-sweep."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtune import cli
from kvtune.commands import sweep as sweep_command
from kvtune.engine import free_port
from kvtune.observability import grafana
from kvtune.observability.dashboards import all_dashboards
from kvtune.sweep import grafana_annotations, run_dir
from kvtune.sweep.records import TrialRecord, describe
from kvtune.sweep.spec import SweepSpec
from kvtune.sweep.sweeper import run_sweep
from kvtune.sweep.trial import TrialPlan
from tests.grafana_standin import GrafanaStandIn
from tests.helpers import FakeHost
from tests.helpers_sweep import SCRIPTED_SPEC, ScriptedTrials

TOKEN = "good-token-0123"
TOKEN_ENV = "KVTUNE_TEST_GRAFANA_TOKEN"
PASSWORD_ENV = "KVTUNE_TEST_GRAFANA_PASSWORD"


@pytest.fixture
def standin(monkeypatch: pytest.MonkeyPatch) -> Iterator[GrafanaStandIn]:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    with GrafanaStandIn(token=TOKEN) as server:
        yield server


def push(url: str, *extra: str) -> int:
    return cli.main(["dashboards", "push", "--url", url, "--token-env", TOKEN_ENV, *extra])


def error_text(capsys: pytest.CaptureFixture[str]) -> str:
    return " ".join(capsys.readouterr().err.split())  # rich wraps long lines


# ---- dashboards push ------------------------------------------------------------------------------------


def test_push_creates_the_folder_and_posts_every_dashboard(standin: GrafanaStandIn) -> None:
    assert push(standin.url) == 0
    assert [f["title"] for f in standin.folders.values()] == ["kvtune"]
    [folder_uid] = standin.folders
    models = all_dashboards()
    posts = standin.calls("POST", "/api/dashboards/db")
    assert [p.body["dashboard"]["uid"] for p in posts] == [m["uid"] for m in models.values()]
    for post, model in zip(posts, models.values(), strict=True):
        assert post.body["folderUid"] == folder_uid
        assert post.body["overwrite"] is True
        sent = post.body["dashboard"]
        assert sent["id"] is None  # found by uid, never by another Grafana's id
        assert {k: v for k, v in sent.items() if k != "id"} == {k: v for k, v in model.items() if k != "id"}
        assert sent["title"] and isinstance(sent["panels"], list) and sent["panels"]
    # Every request but the health check carried the token.
    assert {r.authorization for r in standin.requests if r.path != "/api/health"} == {f"Bearer {TOKEN}"}
    assert not standin.calls("POST", "/api/datasources")  # none asked for


def test_pushing_twice_updates_instead_of_duplicating(standin: GrafanaStandIn) -> None:
    assert push(standin.url) == 0
    assert push(standin.url) == 0
    models = all_dashboards()
    assert sorted(standin.dashboards) == sorted(m["uid"] for m in models.values())
    assert {saved["version"] for saved in standin.dashboards.values()} == {2}
    assert len(standin.folders) == 1
    assert len(standin.calls("POST", "/api/folders")) == 1


def test_a_folder_with_the_title_already_there_is_used(standin: GrafanaStandIn) -> None:
    standin.folders["hand-made"] = {"id": 99, "uid": "hand-made", "title": "Engines"}
    assert push(standin.url, "--folder", "Engines") == 0
    assert not standin.calls("POST", "/api/folders")
    assert {saved["folderUid"] for saved in standin.dashboards.values()} == {"hand-made"}


def test_prometheus_url_creates_the_data_source_once(standin: GrafanaStandIn) -> None:
    for _ in range(2):
        assert push(standin.url, "--prometheus-url", "http://127.0.0.1:9090") == 0
    assert len(standin.calls("POST", "/api/datasources")) == 1
    [source] = standin.datasources.values()
    assert (source["name"], source["type"], source["url"], source["access"]) == (
        "kvtune-prometheus", "prometheus", "http://127.0.0.1:9090", "proxy",
    )  # fmt: skip
    # A new address updates the same data source.
    moved = ["--prometheus-url", "http://10.0.0.5:9090", "--datasource-name", "kvtune-prometheus"]
    assert push(standin.url, *moved) == 0
    assert len(standin.calls("POST", "/api/datasources")) == 1
    assert len(standin.calls("PUT", f"/api/datasources/uid/{source['uid']}")) == 1
    assert [s["url"] for s in standin.datasources.values()] == ["http://10.0.0.5:9090"]


def test_push_with_a_user_and_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PASSWORD_ENV, "s3cret")
    with GrafanaStandIn(basic=("admin", "s3cret")) as server:
        code = cli.main(
            ["dashboards", "push", "--url", server.url, "--user", "admin", "--password-env", PASSWORD_ENV]
        )
        assert code == 0
        assert len(server.dashboards) == len(all_dashboards())


def test_an_unreachable_url_exits_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert push(url) == 2
    err = error_text(capsys)
    assert f"cannot reach Grafana at {url} (Connection refused): check the URL" in err


def test_a_url_that_is_not_grafana_exits_2(
    standin: GrafanaStandIn, capsys: pytest.CaptureFixture[str]
) -> None:
    assert push(standin.url + "/elsewhere") == 2
    assert f"{standin.url}/elsewhere does not answer as Grafana (GET /api/health answered 404)" in error_text(
        capsys
    )
    assert not standin.calls("POST", "/api/dashboards/db")


def test_a_rejected_token_exits_2_naming_its_variable(
    standin: GrafanaStandIn, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TOKEN_ENV, "wrong-token-4567")
    assert push(standin.url) == 2
    err = error_text(capsys)
    assert f"Grafana at {standin.url} rejected the token in ${TOKEN_ENV} (401 Unauthorized)" in err
    assert f"set {TOKEN_ENV} to a valid Grafana service account token" in err
    assert "wrong-token-4567" not in err
    assert not standin.folders and not standin.dashboards


def test_a_grafana_error_after_connecting_exits_1(
    standin: GrafanaStandIn, capsys: pytest.CaptureFixture[str]
) -> None:
    standin.fail_with = 500
    assert push(standin.url) == 1
    assert (
        f"Grafana at {standin.url} refused to list dashboards: 500 the stand-in was told to fail"
        in error_text(capsys)
    )


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--token-env", "KVTUNE_TEST_UNSET_VARIABLE"], "KVTUNE_TEST_UNSET_VARIABLE is not set: export"),
        (["--token-env", "glsa_AbC123_0fe1"], "give the variable's name"),
        (["--token-env", "not a name"], "give the variable's name"),
        (["--token-env", "s3cretvalue42"], "its name is not shown"),
        (["--user", "admin"], "--user needs --password-env NAME"),
    ],
)
def test_bad_credential_flags_exit_2(
    standin: GrafanaStandIn, capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    assert cli.main(["dashboards", "push", "--url", standin.url, *argv]) == 2
    err = error_text(capsys)
    assert expected in err
    assert "glsa_AbC123_0fe1" not in err and "s3cretvalue42" not in err  # values never echoed
    assert not standin.calls("POST", "/api/dashboards/db")


def test_a_token_is_no_flag_and_a_credential_is_required(standin: GrafanaStandIn) -> None:
    for argv in (["--token", TOKEN], [], ["--token-env", TOKEN_ENV, "--user", "admin"]):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["dashboards", "push", "--url", standin.url, *argv])
        assert exit_.value.code == 2
    assert [r.path for r in standin.requests] == []


def test_build_writes_every_dashboard(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "dashboards"
    assert cli.main(["dashboards", "build", "--out", str(out)]) == 0
    models = all_dashboards()
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{stem}.json" for stem in models)
    for stem, model in models.items():
        assert json.loads((out / f"{stem}.json").read_text()) == model
    assert capsys.readouterr().out.split() == [str(out / f"{stem}.json") for stem in models]


def test_build_refuses_an_out_that_is_not_a_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tmp_path / "dashboards.json"
    file.write_text("{}")
    assert cli.main(["dashboards", "build", "--out", str(file)]) == 2
    assert (
        f"--out {file}: is a file, not a folder; give the folder to write the dashboards into"
        in error_text(capsys)
    )
    assert cli.main(["dashboards", "build", "--out", str(file / "inside")]) == 2
    assert f"--out {file / 'inside'}: cannot write the dashboards there (Not a directory)" in error_text(
        capsys
    )
    assert file.read_text() == "{}"


@pytest.mark.parametrize("timeout", ["0", "nan", "inf", "-1", "1e6"])
def test_push_refuses_a_timeout_that_is_no_bound(
    standin: GrafanaStandIn, capsys: pytest.CaptureFixture[str], timeout: str
) -> None:
    assert push(standin.url, f"--timeout={timeout}") == 2
    assert f"--timeout {float(timeout):g}: give the seconds each Grafana answer may take, above 0" in (
        error_text(capsys)
    )
    assert standin.requests == []


def test_a_grafana_answering_the_wrong_shape_exits_1(
    standin: GrafanaStandIn, capsys: pytest.CaptureFixture[str]
) -> None:
    standin.folders["kvtune"] = {"uid": ["not", "a", "uid"], "title": "kvtune"}
    assert push(standin.url) == 1
    assert (
        f"Grafana at {standin.url} answered an object when asked to read folder 'kvtune', not an object with "
        "a 'uid'" in error_text(capsys)
    )


def test_annotate_sends_a_point_or_a_region(standin: GrafanaStandIn) -> None:
    credential = grafana.Credential(TOKEN, "the test token", "use the test token")
    with grafana.connect(standin.url, credential) as board:
        assert board.version == "11.3.0"
        board.annotate("a point", ["kvtune"], 1_000)
        board.annotate("a region", ["kvtune", "x"], 1_000, 2_500, dashboard_uid="kvtune-sweep")
    point, region = standin.annotations
    assert (point["text"], point["tags"], point["time"], point["timeEnd"]) == (
        "a point",
        ["kvtune"],
        1_000,
        None,
    )
    assert "dashboardUID" not in point  # the organization's: every dashboard querying its tags shows it
    assert (region["time"], region["timeEnd"], region["dashboardUID"]) == (1_000, 2_500, "kvtune-sweep")


# ---- sweep annotations ----------------------------------------------------------------------------------


@pytest.fixture
def sweep_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_host: FakeHost) -> Path:
    """A sweep spec whose trials are scripted: `kvtune sweep` runs as a user runs it, minus the engines."""
    fake_host.use("avx2")  # three trials, one pruned
    monkeypatch.setattr(sweep_command, "resolve_model", lambda _model, _cache: None)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(SCRIPTED_SPEC))
    return path


def scripted_sweep(monkeypatch: pytest.MonkeyPatch, trials: ScriptedTrials) -> None:
    def run(spec: SweepSpec, run: Path, **kwargs: Any) -> Any:
        return run_sweep(spec, run, **(kwargs | {"trial_runner": trials, "quality": None}))

    monkeypatch.setattr(sweep_command, "run_sweep", run)


def sweep(spec: Path, runs: Path, url: str) -> int:
    return cli.main(
        ["sweep", str(spec), "--runs-dir", str(runs), "--grafana-url", url, "--grafana-token-env", TOKEN_ENV]
    )


def finished_run(runs: Path) -> tuple[str, list[TrialRecord]]:
    run = (runs / "unit-latest").resolve()
    return run.name, sorted(run_dir.finished_trials(run), key=lambda r: r.trial)


def test_sweep_posts_one_annotation_per_trial(
    standin: GrafanaStandIn, sweep_spec: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scripted_sweep(monkeypatch, ScriptedTrials())
    before = time.time() * 1000
    assert sweep(sweep_spec, tmp_path / "runs", standin.url) == 0
    after = time.time() * 1000
    run_name, records = finished_run(tmp_path / "runs")
    assert len(records) == 3  # the pruned config never ran: nothing to mark on a dashboard
    assert len(standin.annotations) == len(records)
    for note, record in zip(standin.annotations, records, strict=True):
        assert note["tags"] == ["kvtune", "sweep", run_name]
        assert f"trial {record.trial} [{record.config_id}] {describe(record.knobs)}" in note["text"]
        assert f"goodput {record.goodput:.3g} req/s" in note["text"]
        assert before <= note["time"] <= note["timeEnd"] <= after
    assert {r.authorization for r in standin.calls("POST", "/api/annotations")} == {f"Bearer {TOKEN}"}


class FailingTrials(ScriptedTrials):
    """The second trial fails (a failure is annotated too); Grafana breaks while the second one runs."""

    def __init__(self, standin: GrafanaStandIn, how: str) -> None:
        super().__init__()
        self.standin, self.how = standin, how

    def __call__(self, spec: SweepSpec, plan: TrialPlan, **kwargs: Any) -> TrialRecord:
        if len(self.calls) == 1:
            if self.how == "gone":
                self.standin.stop()
            else:
                self.standin.fail_with = 500
        return super().__call__(spec, plan, **kwargs)


@pytest.mark.parametrize("how", ["500", "gone"])
def test_a_grafana_failing_mid_sweep_does_not_fail_the_sweep(
    how: str,
    standin: GrafanaStandIn,
    sweep_spec: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    scripted_sweep(monkeypatch, FailingTrials(standin, how))
    assert sweep(sweep_spec, tmp_path / "runs", standin.url) == 0
    run_name, records = finished_run(tmp_path / "runs")
    assert len(records) == 3
    summary = json.loads(((tmp_path / "runs" / "unit-latest") / run_dir.SUMMARY_FILE).read_text())
    assert summary["finished"] and summary["best"] is not None
    [first] = standin.annotations  # posted before Grafana broke
    assert first["tags"] == ["kvtune", "sweep", run_name] and records[0].config_id in first["text"]
    annotations = grafana_annotations.__name__
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name == annotations]
    assert len(warnings) == 1
    assert "trial 2's Grafana annotation was not posted" in warnings[0].getMessage()
    assert "the sweep goes on" in warnings[0].getMessage()


def test_sweep_refuses_an_unreachable_grafana_before_starting(
    sweep_spec: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    scripted_sweep(monkeypatch, trials := ScriptedTrials())
    url = f"http://127.0.0.1:{free_port()}"
    assert sweep(sweep_spec, tmp_path / "runs", url) == 2
    assert f"cannot reach Grafana at {url}" in error_text(capsys)
    assert not (tmp_path / "runs").exists() and not trials.calls


def test_sweep_refuses_a_rejected_token_before_starting(
    standin: GrafanaStandIn,
    sweep_spec: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(TOKEN_ENV, "wrong-token-4567")
    scripted_sweep(monkeypatch, trials := ScriptedTrials())
    assert sweep(sweep_spec, tmp_path / "runs", standin.url) == 2
    err = error_text(capsys)
    assert f"rejected the token in ${TOKEN_ENV} (401 Unauthorized)" in err and "wrong-token-4567" not in err
    assert not (tmp_path / "runs").exists() and not trials.calls
    assert not standin.annotations
