"""``splitserve top``'s requests carry the operators' key to the URL asked only: a redirect is an
error, never followed (with the key) elsewhere; an answer over its size bound is an error, not
read whole."""

from __future__ import annotations

import http.server
import threading
import urllib.error

import pytest

from splitserve import top


class Seen(http.server.BaseHTTPRequestHandler):
    keys: list = []

    def do_GET(self):
        Seen.keys.append((self.path, self.headers.get("Authorization")))
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/elsewhere")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = b"q" * (top.MAX_ANSWER_BYTES + 10 if self.path == "/huge" else 10)
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:  # the reader stopped at its bound
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Seen)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_redirect_is_not_followed_with_the_key(url):
    Seen.keys.clear()
    with pytest.raises(urllib.error.HTTPError) as refused:
        top._get(url + "/moved", {"Authorization": "Bearer op-key"})
    assert refused.value.code == 302
    assert Seen.keys == [("/moved", "Bearer op-key")]  # /elsewhere never asked


def test_an_answer_over_the_bound_is_an_error(url):
    with pytest.raises(ValueError, match="larger than"):
        top._get(url + "/huge")
    assert top._get(url + "/small") == b"q" * 10
