"""A stand-in for the Hugging Face hub on 127.0.0.1: the endpoints `huggingface_hub` downloads through
(`HF_ENDPOINT` pointed at it), serving repositories of local files, for the repo-id tests.

It answers what the real hub answers for the calls huggingface_hub makes: model info at a revision
(`/api/models/{id}[/revision/{rev}]`, with the commit and file list), the file tree
(`/api/models/{id}/tree/{rev}`), and files (`HEAD`/`GET /{id}/resolve/{rev}/{path}`: commit, ETag and
size headers, byte ranges); the hub's errors with their `X-Error-Code` (RepoNotFound 404, or 401
without a token; GatedRepo 403; RevisionNotFound 404). It records every request, can cut a file's
first transfer short (to see the client resume), and can be stopped to stand for no network.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


@dataclass
class Repo:
    """A repository: its revisions (branch or tag -> commit) and each commit's files (path -> bytes)."""

    commits: dict[str, dict[str, bytes]]
    refs: dict[str, str]
    token: str | None = None  # a token it needs (private): requests without it get 401
    gated: bool = False  # with the token, still 403 (its conditions not accepted)

    @classmethod
    def from_directory(cls, directory: Path, extra: dict[str, bytes] | None = None, **kwargs) -> Repo:
        files = {p.relative_to(directory).as_posix(): p.read_bytes() for p in directory.rglob("*") if p.is_file()}
        files.update(extra or {})
        commit = _commit_of(files)
        return cls(commits={commit: files}, refs={"main": commit}, **kwargs)

    def add_revision(self, name: str, files: dict[str, bytes]) -> str:
        commit = _commit_of(files)
        self.commits[commit] = files
        self.refs[name] = commit
        return commit


def _commit_of(files: dict[str, bytes]) -> str:
    digest = hashlib.sha1()
    for name in sorted(files):
        digest.update(name.encode() + hashlib.sha1(files[name]).digest())
    return digest.hexdigest()


@dataclass
class FakeHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    # (method, path, headers by lower-case name)
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    # File paths whose first GET stops after this many bytes (the connection drops).
    cut_once: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                hub._handle(self, head=True)

            def do_GET(self) -> None:
                hub._handle(self, head=False)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def paths(self, method: str = "GET") -> list[str]:
        return [path for m, path, _ in self.requests if m == method]

    # ----------------------------------------------------------------------------------------------

    _INFO = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/?]+))?$")
    _TREE = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/?]+)(?:/(?P<path>.*))?$")
    _FILE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")

    def _handle(self, handler: BaseHTTPRequestHandler, head: bool) -> None:
        path = urlparse(handler.path).path
        self.requests.append((handler.command, path, {k.lower(): v for k, v in handler.headers.items()}))
        for pattern, serve in ((self._TREE, self._tree), (self._INFO, self._info), (self._FILE, self._file)):
            match = pattern.match(path)
            if match:
                serve(handler, head, **{k: unquote(v) if v else v for k, v in match.groupdict().items()})
                return
        _send(handler, 404, b'{"error": "not found"}', head=head)

    def _repo(self, handler: BaseHTTPRequestHandler, head: bool, repo_id: str, revision: str | None):
        """(repo, commit) for the request, or None after sending the hub's error."""
        repo = self.repos.get(repo_id)
        auth = handler.headers.get("Authorization", "")
        if repo is None or (repo.token is not None and auth != f"Bearer {repo.token}"):
            # (the hub answers 401 for both without a token: it does not tell whether a private repo exists)
            status = 401 if not auth else 404
            _send(handler, status, b'{"error": "Repository not found"}', head=head, error_code="RepoNotFound")
            return None
        if repo.gated:
            _send(handler, 403, b'{"error": "Access to this model is restricted"}', head=head, error_code="GatedRepo")
            return None
        revision = revision or "main"
        commit = repo.refs.get(revision, revision if revision in repo.commits else None)
        if commit is None:
            _send(handler, 404, b'{"error": "Invalid rev id"}', head=head, error_code="RevisionNotFound")
            return None
        return repo, commit

    def _info(self, handler: BaseHTTPRequestHandler, head: bool, repo: str, rev: str | None) -> None:
        found = self._repo(handler, head, repo, rev)
        if found is None:
            return
        files = found[0].commits[found[1]]
        body = {
            "id": repo,
            "modelId": repo,
            "sha": found[1],
            "private": found[0].token is not None,
            "siblings": [{"rfilename": name} for name in sorted(files)],
        }
        _send(handler, 200, json.dumps(body).encode(), head=head)

    def _tree(self, handler: BaseHTTPRequestHandler, head: bool, repo: str, rev: str, path: str | None) -> None:
        found = self._repo(handler, head, repo, rev)
        if found is None:
            return
        files = found[0].commits[found[1]]
        entries = [
            {"type": "file", "oid": hashlib.sha1(data).hexdigest(), "size": len(data), "path": name}
            for name, data in sorted(files.items())
        ]
        _send(handler, 200, json.dumps(entries).encode(), head=head)

    def _file(self, handler: BaseHTTPRequestHandler, head: bool, repo: str, rev: str, path: str) -> None:
        found = self._repo(handler, head, repo, rev)
        if found is None:
            return
        data = found[0].commits[found[1]].get(path)
        if data is None:
            _send(handler, 404, b'{"error": "Entry not found"}', head=head, error_code="EntryNotFound")
            return
        headers = {"X-Repo-Commit": found[1], "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}
        start = 0
        ranged = re.match(r"bytes=(\d+)-$", handler.headers.get("Range", ""))
        if ranged and not head:
            start = int(ranged.group(1))
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        if not head and path in self.cut_once and not ranged:
            _send(handler, 200, data, head=False, headers=headers, cut_at=self.cut_once.pop(path))
            return
        _send(handler, 206 if start else 200, data[start:], head=head, headers=headers)


def _send(
    handler: BaseHTTPRequestHandler,
    status: int,
    body: bytes,
    *,
    head: bool,
    error_code: str | None = None,
    headers: dict[str, str] | None = None,
    cut_at: int | None = None,
) -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json" if status >= 400 else "application/octet-stream")
    handler.send_header("Content-Length", str(len(body)))
    if error_code is not None:
        handler.send_header("X-Error-Code", error_code)
    for name, value in (headers or {}).items():
        handler.send_header(name, value)
    handler.end_headers()
    if head:
        return
    if cut_at is not None:
        handler.wfile.write(body[:cut_at])
        handler.wfile.flush()
        handler.close_connection = True
        handler.connection.shutdown(2)
        return
    handler.wfile.write(body)
