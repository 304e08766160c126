"""A stand-in for the Hugging Face hub on 127.0.0.1: dataset repos with commits and branches, served the
way huggingface.co serves them to the real `huggingface_hub` and `datasets` clients (repo info by
revision, the tree API paginated by Link headers, paths-info, resolve URLs with LFS headers and range
requests). Point HF_ENDPOINT at `Hub.url`. Nothing inside the project is mocked."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.local_http import end_body, serve

API = re.compile(r"^/api/datasets/(?P<repo>[^/]+/[^/]+)(?:/(?P<op>revision|tree|paths-info)/(?P<rev>[^/]+)"
                 r"(?:/(?P<path>.*))?)?$")
RESOLVE = re.compile(r"^/datasets/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
GIT_FILES = ("README.md", ".gitattributes")  # stored in git; every other file in LFS


class Hub:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.commits: dict[str, dict[str, Path]] = {}  # repo -> sha -> the commit's files
        self.branches: dict[str, dict[str, str]] = {}  # repo -> branch -> sha
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Authorization)
        self.served_bytes = 0  # file bytes sent by resolve URLs
        self.corrupt: set[str] = set()  # paths served with the right size and the wrong bytes
        self.server = serve(self.handle)
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def publish(self, repo: str, files: dict[str, bytes], branch: str = "main") -> str:
        """A new commit of `repo` holding exactly `files` (repo path -> bytes); `branch` moves to it."""
        n = len(self.commits.get(repo, {}))
        sha = hashlib.sha1(f"{repo}#{n}".encode()).hexdigest()
        tree = self.root / repo.replace("/", "--") / sha
        for rel, data in files.items():
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            (tree / rel).write_bytes(data)
        self.commits.setdefault(repo, {})[sha] = tree
        self.branches.setdefault(repo, {})[branch] = sha
        return sha

    def tree(self, repo: str, rev: str = "main") -> Path | None:
        sha = self.branches.get(repo, {}).get(rev, rev)
        return self.commits.get(repo, {}).get(sha)

    # --- serving ----------------------------------------------------------------------------------

    def handle(self, h, head):
        u = urlparse(h.path)
        path = unquote(u.path)
        self.requests.append((h.command, path, h.headers.get("Authorization")))
        body = h.rfile.read(int(h.headers.get("Content-Length") or 0)) if h.command == "POST" else b""
        if m := API.match(path):
            return self._api(h, head, u, m, body)
        if (m := RESOLVE.match(path)) and (tree := self.tree(m["repo"], m["rev"])) and (tree / m["path"]).is_file():
            return self._resolve(h, head, m["repo"], m["rev"], m["path"], tree)
        self._send(h, head, 404, b'{"error": "Entry not found"}', {"X-Error-Code": "EntryNotFound"})

    def _api(self, h, head, u, m, body):
        repo, rev = m["repo"], m["rev"] or "main"
        tree = self.tree(repo, rev)
        if tree is None:
            return self._send(h, head, 404, b'{"error": "Repository not found"}',
                              {"X-Error-Code": "RepositoryNotFound"})
        sha = tree.name
        if m["op"] in (None, "revision"):
            files = sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file())
            info = {"id": repo, "sha": sha, "private": False, "gated": False, "disabled": False, "downloads": 0,
                    "likes": 0, "tags": [], "siblings": [{"rfilename": f} for f in files],
                    "lastModified": "2026-11-01T00:00:00.000Z", "createdAt": "2026-11-01T00:00:00.000Z"}
            return self._json(h, head, info)
        if m["op"] == "paths-info":
            form = parse_qs(body.decode())
            paths = form.get("paths") or (json.loads(body or b"{}").get("paths") or [])
            return self._json(h, head, [self._entry(tree, p) for p in paths if (tree / p).exists()])
        # tree: the entries under a folder, recursive or not, two per page (clients must follow Link)
        q = parse_qs(u.query)
        base = tree / (m["path"] or "")
        found = base.rglob("*") if q.get("recursive", ["false"])[0] == "true" else base.iterdir()
        entries = [self._entry(tree, p.relative_to(tree).as_posix()) for p in sorted(found)]
        cursor = int(q.get("cursor", ["0"])[0])
        headers = {}
        if cursor + 2 < len(entries):
            nxt = {**{k: v[0] for k, v in q.items()}, "cursor": str(cursor + 2)}
            query = "&".join(f"{k}={v}" for k, v in nxt.items())
            headers["Link"] = f'<{self.url}{u.path}?{query}>; rel="next"'
        self._json(h, head, entries[cursor:cursor + 2], headers)

    def _entry(self, tree: Path, rel: str) -> dict:
        p = tree / rel
        if p.is_dir():
            return {"type": "directory", "oid": hashlib.sha1(rel.encode()).hexdigest(), "path": rel}
        data = p.read_bytes()
        e = {"type": "file", "oid": hashlib.sha1(data).hexdigest(), "size": len(data), "path": rel}
        if rel not in GIT_FILES:
            e["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return e

    def _resolve(self, h, head, repo, rev, rel, tree):
        data = (tree / rel).read_bytes()
        etag = hashlib.sha1(data).hexdigest() if rel in GIT_FILES else hashlib.sha256(data).hexdigest()
        if rel in self.corrupt:
            data = data[:-10] + b"0123456789"  # same size, wrong bytes
        start, end = 0, len(data) - 1
        if rng := re.match(r"bytes=(\d+)-(\d*)", h.headers.get("Range") or ""):
            start, end = int(rng[1]), int(rng[2]) if rng[2] else end
        headers = {"X-Repo-Commit": tree.name, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
        if rng:
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
        if not head:
            self.served_bytes += end + 1 - start
        self._send(h, head, 206 if rng else 200, data[start:end + 1], headers)

    def _json(self, h, head, obj, headers=None):
        self._send(h, head, 200, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})})

    @staticmethod
    def _send(h, head, code, body, headers):
        h.send_response(code)
        for k, v in headers.items():
            h.send_header(k, v)
        end_body(h, head, body)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def standin(tmp_path, monkeypatch):
    """The hub stand-in, with the environment a hub user has (token, endpoint, own caches)."""
    server = Hub(tmp_path / "hub")
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("GPTPIPE_HOME", str(tmp_path / "home"))
    yield server
    server.close()


def parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


ARC = "allenai/ai2_arc"  # lm-evaluation-harness's arc_easy reads this repo's ARC-Easy config
ARC_CARD = """---
configs:
- config_name: ARC-Easy
  data_files:
  - split: train
    path: ARC-Easy/train-*
  - split: validation
    path: ARC-Easy/validation-*
  - split: test
    path: ARC-Easy/test-*
---
# ARC-Easy, as the hub lays it out (a stand-in's made-up questions)
"""


def publish_arc_easy(hub: Hub, n_test: int = 12) -> str:
    """ARC-Easy laid out as the hub serves allenai/ai2_arc (a dataset card declaring the config's parquet
    files), so the harness's own `arc_easy` task definition loads it through `datasets`."""
    def split(n: int, tag: str) -> pa.Table:
        return pa.table({
            "id": [f"{tag}-{i}" for i in range(n)],
            "question": [f"Which of these is number {i} of the {tag} questions?" for i in range(n)],
            "choices": [{"text": ["a rock", "a tree", "the sea", "a star"], "label": ["A", "B", "C", "D"]}] * n,
            "answerKey": ["ABCD"[i % 4] for i in range(n)]})

    return hub.publish(ARC, {"README.md": ARC_CARD.encode(),
                             **{f"ARC-Easy/{s}-00000-of-00001.parquet": parquet_bytes(split(n, s))
                                for s, n in (("train", 4), ("validation", 4), ("test", n_test))}})
