"""A local HTTP server for tests that stand in for a remote service (the Hugging Face hub, a dataset
host): real sockets on 127.0.0.1, real HTTP clients, nothing mocked."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def serve(handle) -> ThreadingHTTPServer:
    """Start a server on a free 127.0.0.1 port in a daemon thread. `handle(request_handler, head)` answers
    every GET and POST (head=False) and HEAD (head=True). Stop it with .shutdown() and .server_close()."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_HEAD(self):
            handle(self, head=True)

        def do_GET(self):
            handle(self, head=False)

        def do_POST(self):
            handle(self, head=False)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def end_body(h, head: bool, body: bytes) -> None:
    """Finish a response whose status and headers are sent: its length, then the body (not for HEAD)."""
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    if not head:
        h.wfile.write(body)
