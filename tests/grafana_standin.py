"""A stand-in for the parts of Grafana's HTTP API kvtune calls, on 127.0.0.1 and a free port.

It keeps folders, dashboards (one per uid, versioned; overwrite semantics as Grafana's), data sources and
annotations in memory, checks every /api request but /api/health against one token or one user and
password (401 otherwise, as Grafana answers), records every request it gets, and can be told to fail.
"""

from __future__ import annotations

import base64
import json
import re
import threading
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

VERSION = "11.3.0"


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    authorization: str | None
    body: Any


@dataclass
class Answer:
    status: int
    body: Any


def _error(status: int, message: str) -> Answer:
    return Answer(status, {"message": message})


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


@dataclass
class GrafanaStandIn:
    """Use as a context manager; `url` is where it answers. Set `fail_with` to an HTTP status to make every
    authenticated request fail with it (a Grafana breaking mid-run); `stop()` takes it away altogether."""

    token: str | None = None
    basic: tuple[str, str] | None = None
    fail_with: int | None = None
    requests: list[Request] = field(default_factory=list)
    folders: dict[str, dict[str, Any]] = field(default_factory=dict)
    dashboards: dict[str, dict[str, Any]] = field(
        default_factory=dict
    )  # uid -> {dashboard, folderUid, version}
    datasources: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> data source
    annotations: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = 0
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._running = False
        self.stopped = False

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self) -> GrafanaStandIn:
        self._thread.start()
        self._running = True
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop answering and close the port: later requests are refused connections."""
        self.stopped = True
        if self._running:
            self._server.shutdown()
            self._thread.join()
            self._running = False
        self._server.server_close()

    def calls(self, method: str, path: str) -> list[Request]:
        """The recorded requests to `method path` (path without the query)."""
        return [r for r in self.requests if r.method == method and r.path == path]

    # ---- the API ----------------------------------------------------------------------------------------

    def answer(self, request: Request) -> Answer:
        with self._lock:
            self.requests.append(request)
            if request.path == "/api/health":
                return Answer(200, {"commit": "standin", "database": "ok", "version": VERSION})
            if not self._authorized(request.authorization):
                return _error(401, "Invalid API key" if self.token else "Invalid username or password")
            if self.fail_with is not None:
                return _error(self.fail_with, "the stand-in was told to fail")
            return self._route(request)

    def _authorized(self, header: str | None) -> bool:
        if header is None:
            return False
        if self.token is not None and header == f"Bearer {self.token}":
            return True
        if self.basic is not None:
            expected = base64.b64encode(":".join(self.basic).encode()).decode()
            return header == f"Basic {expected}"
        return False

    def _next_id(self) -> int:
        self._ids += 1
        return self._ids

    def _route(self, r: Request) -> Answer:
        parts = r.path.removeprefix("/api/").split("/")
        route = (r.method, parts[0])
        if route == ("GET", "search"):
            return self._search(r.query)
        if route == ("GET", "folders") and len(parts) == 1:
            return Answer(
                200, [{"id": f["id"], "uid": f["uid"], "title": f["title"]} for f in self.folders.values()]
            )
        if route == ("GET", "folders") and len(parts) == 2:
            folder = self.folders.get(parts[1])
            return Answer(200, folder) if folder else _error(404, "folder not found")
        if route == ("POST", "folders"):
            return self._create_folder(r.body)
        if route == ("POST", "dashboards") and parts[1:] == ["db"]:
            return self._save_dashboard(r.body)
        if route == ("GET", "dashboards") and len(parts) == 3 and parts[1] == "uid":
            saved = self.dashboards.get(parts[2])
            if saved is None:
                return _error(404, "Dashboard not found")
            meta = {"folderUid": saved["folderUid"], "version": saved["version"]}
            return Answer(200, {"dashboard": saved["dashboard"], "meta": meta})
        if route == ("GET", "datasources") and len(parts) == 1:
            return Answer(200, list(self.datasources.values()))
        if route == ("GET", "datasources") and len(parts) == 3 and parts[1] == "name":
            found = self.datasources.get(unquote(parts[2]))
            return Answer(200, found) if found else _error(404, "Data source not found")
        if route == ("POST", "datasources") and len(parts) == 1:
            return self._create_datasource(r.body)
        if route == ("PUT", "datasources") and len(parts) == 3 and parts[1] == "uid":
            return self._update_datasource(parts[2], r.body)
        if route == ("POST", "annotations") and len(parts) == 1:
            return self._annotate(r.body)
        return _error(404, "Not found")

    def _search(self, query: dict[str, list[str]]) -> Answer:
        hits = [{"uid": f["uid"], "title": f["title"], "type": "dash-folder"} for f in self.folders.values()]
        hits += [
            {"uid": uid, "title": d["dashboard"]["title"], "type": "dash-db", "folderUid": d["folderUid"]}
            for uid, d in self.dashboards.items()
        ]
        if "query" in query:
            hits = [h for h in hits if query["query"][0].lower() in str(h["title"]).lower()]
        if "type" in query:
            hits = [h for h in hits if h["type"] == query["type"][0]]
        if "limit" in query:
            hits = hits[: int(query["limit"][0])]
        return Answer(200, hits)

    def _create_folder(self, body: Any) -> Answer:
        if not isinstance(body, dict) or not body.get("title"):
            return _error(400, "folder title cannot be empty")
        uid = str(body.get("uid") or f"f{self._ids + 1}")
        if uid in self.folders:
            return _error(409, "a folder with the same uid already exists")
        if any(f["title"] == body["title"] for f in self.folders.values()):
            return _error(409, "a folder with the same name already exists")
        folder = {"id": self._next_id(), "uid": uid, "title": body["title"], "url": f"/dashboards/f/{uid}/"}
        self.folders[uid] = folder
        return Answer(200, folder)

    def _save_dashboard(self, body: Any) -> Answer:
        if not isinstance(body, dict) or not isinstance(body.get("dashboard"), dict):
            return _error(400, "bad request data: no dashboard")
        model = body["dashboard"]
        uid, title = model.get("uid"), model.get("title")
        if not uid or not title:
            return _error(400, "Dashboard title cannot be empty" if not title else "uid required here")
        folder_uid = body.get("folderUid") or ""
        if folder_uid and folder_uid not in self.folders:
            return _error(400, "folder not found")
        existing = self.dashboards.get(uid)
        if existing is not None and not body.get("overwrite"):
            return Answer(
                412, {"message": "A dashboard with the same uid already exists", "status": "name-exists"}
            )
        clash = [
            other
            for other, saved in self.dashboards.items()
            if other != uid and saved["folderUid"] == folder_uid and saved["dashboard"]["title"] == title
        ]
        if clash:
            message = "A dashboard with the same name in the folder already exists"
            return Answer(412, {"message": message, "status": "name-exists"})
        version = existing["version"] + 1 if existing else 1
        ident = existing["id"] if existing else self._next_id()
        self.dashboards[uid] = {
            "id": ident,
            "dashboard": {**model, "id": ident, "version": version},
            "folderUid": folder_uid,
            "version": version,
        }
        slug = _slug(title)
        answer = {"id": ident, "uid": uid, "url": f"/d/{uid}/{slug}", "status": "success", "version": version}
        return Answer(200, answer | {"slug": slug})

    def _create_datasource(self, body: Any) -> Answer:
        if not isinstance(body, dict) or not body.get("name") or not body.get("type"):
            return _error(400, "name and type are required")
        if body["name"] in self.datasources:
            return _error(409, "data source with the same name already exists")
        ident = self._next_id()
        source = {**body, "id": ident, "uid": str(body.get("uid") or f"ds{ident}")}
        self.datasources[body["name"]] = source
        return Answer(
            200, {"datasource": source, "id": ident, "message": "Datasource added", "name": body["name"]}
        )

    def _update_datasource(self, uid: str, body: Any) -> Answer:
        for name, source in self.datasources.items():
            if source["uid"] == uid:
                self.datasources[name] = {**source, **body, "uid": uid, "id": source["id"]}
                return Answer(200, {"datasource": self.datasources[name], "message": "Datasource updated"})
        return _error(404, "Data source not found")

    def _annotate(self, body: Any) -> Answer:
        if not isinstance(body, dict):
            return _error(400, "bad request data")
        ident = self._next_id()
        self.annotations.append({**body, "id": ident})
        return Answer(200, {"id": ident, "message": "Annotation added"})


def _handler_for(standin: GrafanaStandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _serve(self) -> None:
            if standin.stopped:  # a kept-alive connection outlives shutdown(): drop it as a dead server would
                self.close_connection = True
                return
            split = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = raw.decode(errors="replace")
            request = Request(
                self.command, split.path, parse_qs(split.query), self.headers.get("Authorization"), body
            )
            answer = standin.answer(request)
            data = json.dumps(answer.body).encode()
            self.send_response(answer.status, HTTPStatus(answer.status).phrase)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_DELETE = _serve

        def log_message(self, format: str, *args: Any) -> None:
            pass  # the recorded requests are the log

    return Handler
