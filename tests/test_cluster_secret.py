"""The authenticated control plane (``--cluster-secret-file``, ``disagg/control/curve.py``,
``docs/protocol.md``, ``docs/security.md``), on real workers over the tcp transfer backend.

A small relay sits between each decode and its prefill's bootstrap port, as an attacker on the
network would: it forwards ZMTP frames both ways, keeps them, and can inject its own. Two pairs
run side by side, one with a secret and one without (the negative control): a forged, well-formed
``AbortRoom`` and ``HeartbeatAck`` under the real decode's identity and incarnation, injected
into the connection of a live room, abort that room without the secret and change nothing with
it (prefill drops the connection that carried them, decode reconnects, no peer is lost). Decode's
captured connection (its handshake and encrypted messages) replayed changes nothing. A decode with
another secret, or with none, is refused naming authentication on both sides."""

from __future__ import annotations

import os
import random
import re
import socket
import struct
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import requests

from cluster import Cluster, metrics, post_generate
from conftest import REPO, free_port, write_cluster_secret
from helpers.client_text import assert_in_words, logged_ending
from splitserve.disagg import protocol as p

SECURED, OPEN = 0, 1  # the two pairs: prefill i with decode i
WRONG, NONE = 2, OPEN  # decodes with another secret, and without one, sent to the secured prefill


class Relay:
    """Forwards TCP connections from a local port to ``target``, frame by frame after the 64-byte
    ZMTP greeting, keeping every frame (``frames[direction]``: raw bytes, ``"up"`` is client to
    server) and the first connection's whole client-to-server stream (``first_stream``), and
    injecting ``inject(direction, frame)`` into the newest connection between two of its frames,
    once its handshake is over."""

    HANDSHAKE_FRAMES = 2  # NULL: READY; CURVE: HELLO + INITIATE up, WELCOME + READY down

    def __init__(self, target_port: int):
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.frames: dict[str, list[bytes]] = {"up": [], "down": []}
        self.first_stream = b""
        self.connections = 0
        self._pending: dict[tuple[int, str], list[bytes]] = {}
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def inject(self, direction: str, frame: bytes) -> None:
        with self._lock:
            self._pending.setdefault((self.connections, direction), []).append(frame)

    def close(self) -> None:
        self.listener.close()
        for s in self._socks:
            s.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            self._socks += [client, server]
            with self._lock:
                self.connections += 1
                n = self.connections
            threading.Thread(target=self._pump, args=(client, server, "up", n), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, "down", n), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str, n: int) -> None:
        keep = direction == "up" and n == 1

        def read(size: int) -> bytes:
            data = b""
            while len(data) < size:
                chunk = src.recv(size - len(data))
                if not chunk:
                    raise ConnectionError
                data += chunk
            if keep:
                self.first_stream += data
            return data

        try:
            greeting = 0  # 64 bytes, forwarded as they come: each side sends its first part and waits
            while greeting < 64:
                chunk = src.recv(64 - greeting)
                if not chunk:
                    raise ConnectionError
                self.first_stream += chunk if keep else b""
                greeting += len(chunk)
                dst.sendall(chunk)
            frames = 0
            while True:
                flags = read(1)
                size = read(8 if flags[0] & 0x02 else 1)
                body = read(struct.unpack(">Q", size)[0] if flags[0] & 0x02 else size[0])
                frame = flags + size + body
                self.frames[direction].append(frame)
                dst.sendall(frame)
                frames += 1
                if frames >= self.HANDSHAKE_FRAMES:
                    with self._lock:
                        extra = self._pending.pop((n, direction), [])
                    for forged in extra:
                        dst.sendall(forged)
        except OSError:
            src.close()
            dst.close()


def zmtp_message(msg) -> bytes:
    """A plaintext ZMTP message frame holding one encoded control message."""
    body = p.encode(msg)
    return (b"\x00" + bytes([len(body)]) if len(body) < 256 else b"\x02" + struct.pack(">Q", len(body))) + body


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("secrets")
    ours, theirs = write_cluster_secret(folder / "ours"), write_cluster_secret(folder / "theirs")
    ours_args, theirs_args = ["--cluster-secret-file", ours], ["--cluster-secret-file", theirs]
    open_args = ["--insecure-control-plane"]
    cluster = Cluster(prefill=2, decode=3, backend="tcp", router=False, prefill_args=[ours_args, open_args],
                      decode_args=[ours_args, open_args, theirs_args])
    with cluster:
        relays = [Relay(pf.bootstrap_port) for pf in cluster.prefill]
        try:
            yield cluster, relays
        finally:
            for r in relays:
                r.close()


def incarnation_of(worker) -> str:
    m = re.search(r"receiving link decode-([0-9a-f]+)-link", worker.stderr())
    assert m, worker.output_tail()
    return m.group(1)


def lifecycle(worker, kind: str) -> float:
    return sum(v for (name, labels), v in metrics(worker).items()
               if name == "splitserve_lifecycle_entries" and ("kind", kind) in labels)


def run_pair(cluster, relays, i: int, decode_index=None, room=None, between=None, tokens: int = 4):
    """One request through pair ``i`` with decode's control connection through the relay: decode's
    leg first; once prefill holds its registration, ``between()``, then prefill's leg. Decode's response."""
    prefill, decode = cluster.prefill[i], cluster.decode[i if decode_index is None else decode_index]
    room = room if room is not None else random.getrandbits(63)
    extra = {"bootstrap_host": "127.0.0.1", "bootstrap_port": relays[i].port, "bootstrap_room": room}
    ids = [random.randint(10, 200) for _ in range(24)]
    result = {}
    leg = threading.Thread(target=lambda: result.update(r=post_generate(decode.url, ids, tokens, extra=extra,
                                                                        timeout=90)), daemon=True)
    leg.start()
    if between is not None:
        deadline = time.monotonic() + 30
        while lifecycle(prefill, "pending_registrations") < 1:
            assert time.monotonic() < deadline, f"no registration came\n{decode.output_tail()}"
            time.sleep(0.05)
        between(room)
        time.sleep(1.0)  # the forged frames arrive first
    post_generate(prefill.url, ids, tokens, extra={**extra, "bootstrap_port": prefill.bootstrap_port}, timeout=90)
    leg.join(90)
    return result["r"]


@pytest.mark.parametrize("pair", [SECURED, OPEN])
def test_forged_abort_and_heartbeat_ack_change_nothing_with_the_secret_and_abort_a_live_room_without(pairs, pair):
    cluster, relays = pairs
    assert run_pair(cluster, relays, pair).status_code == 200  # the session is up
    decode_inc = incarnation_of(cluster.decode[pair])
    relay = relays[pair]

    def forge(room: int) -> None:
        relay.inject("up", zmtp_message(p.AbortRoom(room, decode_inc, "client_abort")))
        relay.inject("up", zmtp_message(p.HeartbeatAck(decode_inc, 1)))

    r = run_pair(cluster, relays, pair, between=forge)
    if pair == SECURED:
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 4, r.text
        for w in (cluster.prefill[pair], cluster.decode[pair]):
            assert not any(v for (name, labels), v in metrics(w).items()
                           if name == "splitserve_requests_total" and ("outcome", "finished") not in labels), w.url
    else:  # the negative control: the same frames abort the room, so this test can fail
        assert r.status_code != 200 and r.json()["error"]["code"] in ("peer_abort", "peer_lost", "peer_failed"), r.text
    assert run_pair(cluster, relays, pair).status_code == 200  # and the pair serves on


def test_a_captured_frame_replayed_changes_nothing(pairs):
    cluster, relays = pairs
    prefill, decode = cluster.prefill[SECURED], cluster.decode[SECURED]
    assert run_pair(cluster, relays, SECURED).status_code == 200
    relay = relays[SECURED]
    captured = [f for f in relay.frames["up"] if f[2 if not f[0] & 0x02 else 9:].startswith(b"\x07MESSAGE")]
    assert len(captured) >= 3 and relay.first_stream  # CurveZMQ MESSAGE boxes: what decode sent, encrypted
    before = metrics(prefill)

    def replay(room: int) -> None:  # decode's whole first connection, handshake and messages, sent again
        with socket.create_connection(("127.0.0.1", prefill.bootstrap_port)) as s:
            s.sendall(relay.first_stream)
            time.sleep(0.5)

    r = run_pair(cluster, relays, SECURED, between=replay)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 4, r.text
    after = metrics(prefill)
    refused = sum(v for (name, labels), v in after.items() if name == "splitserve_control_bad_frames_total"
                  and dict(labels).get("why", "").startswith("authentication")) - \
        sum(v for (name, labels), v in before.items() if name == "splitserve_control_bad_frames_total"
            and dict(labels).get("why", "").startswith("authentication"))
    assert refused >= 1  # the replayed connection was seen, and refused
    notices = {dict(labels)["kind"]: v for (name, labels), v in after.items() if name == "splitserve_lifecycle_notices_total"}
    assert not notices.get("peer_lost") and not notices.get("wrong_peer"), notices
    assert run_pair(cluster, relays, SECURED).status_code == 200


@pytest.mark.parametrize("decode_index, words", [(WRONG, "authentication failed"), (NONE, "authentication failed")])
def test_a_decode_with_another_secret_or_none_is_refused_naming_authentication(pairs, decode_index, words):
    cluster, _ = pairs
    extra = {"bootstrap_host": "127.0.0.1", "bootstrap_port": cluster.prefill[SECURED].bootstrap_port,
             "bootstrap_room": random.getrandbits(63)}
    started = time.monotonic()
    r = post_generate(cluster.decode[decode_index].url, [5, 6, 7], 2, extra=extra, timeout=90)  # decode's leg only
    assert r.status_code != 200, r.text
    assert_in_words(r.json()["error"], "incompatible_peer", cluster.prefill[SECURED].bootstrap_port)
    assert time.monotonic() - started < 30  # at once, not at the 45 s bootstrap deadline
    assert words in logged_ending(cluster.decode[decode_index], r.headers["X-Request-Id"], "incompatible_peer")
    assert "authentication failed" in cluster.prefill[SECURED].stderr()


def test_one_warning_without_a_secret_and_no_transfer_metadata_anywhere(pairs):
    cluster, _ = pairs
    warning = "control plane UNAUTHENTICATED"
    for w in cluster.workers:
        secured = w in (cluster.prefill[SECURED], cluster.decode[SECURED], cluster.decode[WRONG])
        assert w.stderr().count(warning) == (0 if secured else 1), w.output_tail()
        for path in ("/get_server_info", "/debug/requests", "/metrics"):
            text = requests.get(w.url + path, timeout=10).text
            assert "tcp://" not in text and "agent_metadata" not in text, (w.url, path)
        assert "tcp://" not in w.stderr() and "agent_metadata" not in w.stderr(), w.output_tail()


def test_a_secret_file_that_cannot_serve_is_refused_naming_it(tmp_path, caplog):
    """At least 32 random bytes as hex or base64, in a file other users cannot read (its group may,
    with a warning); each refusal names the file and never repeats what it holds."""
    import base64
    import secrets

    from splitserve.disagg.control.curve import ClusterSecret

    def secret_file(name: str, text: str, mode: int = 0o600) -> str:
        path = tmp_path / name
        path.write_text(text + "\n")
        path.chmod(mode)
        return str(path)

    raw = secrets.token_bytes(32)
    for name, text, words in [
        ("short", secrets.token_hex(16), "at least 32 random bytes, this one 16"),
        ("short64", base64.b64encode(secrets.token_bytes(31)).decode(), "at least 32 random bytes, this one 31"),
        ("phrase", "the cluster's own secret, 32+ bytes long", "written as hex or base64"),
    ]:
        with pytest.raises(ValueError, match=f"--cluster-secret-file {tmp_path / name}: a cluster secret") as info:
            ClusterSecret.load(secret_file(name, text))
        assert words in str(info.value) and text not in str(info.value)
    for mode in (0o644, 0o604, 0o602):
        with pytest.raises(ValueError, match="every user of this machine can read or change it .*chmod 600"):
            ClusterSecret.load(secret_file(f"open{mode:o}", raw.hex(), mode))
    with pytest.raises(ValueError, match="cannot read it"):
        ClusterSecret.load(str(tmp_path / "missing"))
    caplog.set_level("WARNING")
    shared = ClusterSecret.load(secret_file("group", raw.hex(), 0o440))  # a Kubernetes Secret volume with fsGroup
    assert "can be read by its group (mode 440)" in caplog.text
    same = [ClusterSecret.load(secret_file(name, text)) for name, text in (
        ("hex", raw.hex()), ("b64", base64.b64encode(raw).decode()), ("url", base64.urlsafe_b64encode(raw).decode()),
        ("bare", base64.urlsafe_b64encode(raw).decode().rstrip("=")))]
    assert {(s.bind_public, s.connect_public) for s in [shared, *same]} == {(shared.bind_public, shared.connect_public)}
    assert raw.hex() not in repr(shared)


def test_the_curve_keys_are_derived_with_hkdf():
    """RFC 5869's first test vector, and each role's key is HKDF-SHA256 of the secret as
    ``cryptography`` computes it."""
    import zmq
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    from zmq.utils import z85

    from splitserve.disagg.control.curve import HKDF_SALT, derive_keys, hkdf_sha256

    ikm, salt, info = bytes.fromhex("0b" * 22), bytes.fromhex("000102030405060708090a0b0c"), bytes.fromhex("f0f1f2f3f4"
                                                                                                             "f5f6f7f8f9")
    assert hkdf_sha256(ikm, salt, info, 42).hex() == ("3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5b"
                                                      "f34007208d5b887185865")
    secret = bytes(range(32))
    for role in (b"bind", b"connect"):
        want = HKDF(hashes.SHA256(), 32, HKDF_SALT, b"splitserve curve v2 " + role).derive(secret)
        public, private = derive_keys(secret, role)
        assert private == z85.encode(want) and public == zmq.curve_public(private)
    assert derive_keys(secret, b"bind") != derive_keys(secret, b"connect") != derive_keys(bytes(32), b"connect")


def test_closing_a_bootstrap_port_amid_refused_handshakes_leaves_its_context_serving(monkeypatch):
    """The guard reads each guarded socket's monitor (handshakes it refused). Closing the socket
    must stop that monitor before the guard closes its end: a refusal reported in between would
    block the context's I/O thread for ever (libzmq #3575) — here ``zmq.Context.instance()``,
    the process's, which every control socket of a worker shares. (The old order, closing the
    socket first, passed this too: the guard's poll reads for up to 100 ms more; the order is the
    one libzmq documents.)"""
    import os

    import zmq

    from splitserve.disagg.control.curve import ClusterSecret
    from splitserve.disagg.control.prefill_server import ZmqRouterEndpoint

    ctx = zmq.Context()
    monkeypatch.setattr(zmq.Context, "_instance", ctx)  # the endpoint binds on the instance
    monkeypatch.setattr(zmq.Context, "_instance_pid", os.getpid())
    secret = ClusterSecret(b"s" * 32)
    strangers = zmq.Context()  # clients without the secret: every handshake of theirs is refused
    sockets = []

    def socket(context, kind):
        s = context.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        sockets.append(s)
        return s

    try:
        for _ in range(5):
            port = free_port()
            endpoint = ZmqRouterEndpoint("127.0.0.1", port, secret)
            clients = []
            for _ in range(4):
                c = socket(strangers, zmq.DEALER)
                c.setsockopt(zmq.RECONNECT_IVL, 1)  # retry at once: refusals keep coming
                c.connect(f"tcp://127.0.0.1:{port}")
                clients.append(c)
            deadline = time.monotonic() + ARRIVE_S
            while not endpoint.failures and time.monotonic() < deadline:
                time.sleep(0.005)
            assert endpoint.failures, "no handshake was refused"
            endpoint.close()  # while refusals are still being reported
            for c in clients:
                c.close(0)
        probe = socket(ctx, zmq.DEALER)
        server = socket(strangers, zmq.ROUTER)
        probe.connect(f"tcp://127.0.0.1:{server.bind_to_random_port('tcp://127.0.0.1')}")
        probe.send(b"ping")
        served = bool(server.poll(ARRIVE_S * 1000))
        probe.close(0)
        server.close(0)
        assert served, "closing a guarded socket wedged the I/O thread of its context"
        assert _terminated(ctx), "the context can no longer be terminated"
    finally:
        # a failure above must not hang the suite: a context left with open sockets blocks for ever
        # in its term(), also when the garbage collector reaches it in a later test
        for s in sockets:
            s.close(0)
        for context in (ctx, strangers):
            _terminated(context)


def test_a_guard_waits_for_the_zap_endpoint_and_leaves_nothing_open_if_it_never_comes(monkeypatch):
    """A context has one ZAP endpoint. Closing its last guarded socket stops its guard; a socket
    guarded right after (a role switch: the bootstrap port closes, the transfer receiver binds)
    starts a new guard, which binds that endpoint again. A closed ZMQ socket releases its endpoint
    later, on the context's reaper thread (on a busy machine, late enough that the new bind failed
    with "Address already in use"): the old guard unbinds it as it stops, and a new guard waits a
    while for it. One that never comes is an error that leaves no socket open: an open one would
    block the context's termination, and the worker's exit, for ever."""
    import zmq

    from splitserve.disagg.control import curve
    from splitserve.disagg.control.prefill_server import ZmqRouterEndpoint

    ctx, secret, sockets = zmq.Context(), curve.ClusterSecret(b"s" * 32), []
    monkeypatch.setattr(zmq.Context, "_instance", ctx)  # the bootstrap port binds on the instance
    monkeypatch.setattr(zmq.Context, "_instance_pid", os.getpid())

    def socket(kind):
        s = ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        sockets.append(s)
        return s

    try:
        squatter = socket(zmq.REP)  # a guard that has not let go yet
        squatter.bind(curve.ZAP_ENDPOINT)
        threading.Timer(0.3, squatter.unbind, (curve.ZAP_ENDPOINT,)).start()
        guarded = socket(zmq.ROUTER)
        secret.bind(guarded, "a guarded socket")  # waits for the endpoint
        secret.unbind(guarded)
        probe = socket(zmq.REP)
        probe.bind(curve.ZAP_ENDPOINT)  # the stopped guard let go at once
        with pytest.raises(zmq.ZMQError, match="in use"):
            curve.ClusterSecret(b"s" * 32, zap_wait_s=0.2).bind(socket(zmq.ROUTER), "a socket never guarded")
        with pytest.raises(zmq.ZMQError, match="in use"):
            ZmqRouterEndpoint("127.0.0.1", free_port(), curve.ClusterSecret(b"s" * 32, zap_wait_s=0.2))
    finally:
        for s in sockets:
            s.close(0)
        assert _terminated(ctx), "a socket of the context was left open: it can no longer be terminated"


ARRIVE_S = 30.0  # what the machine may take for an event that must come (the wait ends when it does)
_WEDGED = []  # contexts whose term() did not return: kept alive, so that no __del__ calls it again


def _terminated(context) -> bool:
    """Terminate ``context`` in a thread of its own, bounded: whether it ended."""
    if context.closed:
        return True
    ended = threading.Thread(target=context.term, daemon=True)
    ended.start()
    ended.join(ARRIVE_S)
    if ended.is_alive():
        _WEDGED.append(context)
    return not ended.is_alive()


SPLIT_ROLES = ("prefill", "decode")


@pytest.fixture(scope="module")
def without_a_secret() -> dict[str, tuple[int, str]]:
    """A prefill and a decode worker started with no secret, side by side (each loads the server
    in a process of its own): by role, the exit status and stderr."""
    procs = {role: subprocess.Popen([sys.executable, "-m", "splitserve.cli", "serve", "--role", role, "--port", "0",
                                     "--allowed-prefill", "127.0.0.1"], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True, cwd=REPO,
                                    env={**os.environ, "PYTHONPATH": str(REPO)})
             for role in SPLIT_ROLES}
    try:
        seen = {}
        for role, proc in procs.items():
            _, err = proc.communicate(timeout=240)  # a bound on a hang
            seen[role] = (proc.returncode, err)
        return seen
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("role", SPLIT_ROLES)
def test_a_split_worker_without_a_secret_does_not_start_unless_told_insecure(role, without_a_secret):
    """No --cluster-secret-file and no --insecure-control-plane: exit 2 naming both, before the
    model loads (with the flag, the pairs above start and warn)."""
    returncode, stderr = without_a_secret[role]
    assert returncode == 2, stderr[-2000:]
    assert "--cluster-secret-file" in stderr and "--insecure-control-plane" in stderr, stderr[-2000:]


@pytest.mark.parametrize("secured", [True, False], ids=["curve", "plain"])
def test_a_tcp_write_of_the_largest_frames_lands_under_the_secret(secured):
    """A KV write whose frames are as large as the receiver takes (the default 4 MiB: 128 pages of
    the tiny model in one run, a 2,048-token chunk) lands with the cluster secret as without it.
    CURVE adds 33 bytes to every frame on the wire, and ZMQ's ``MAXMSGSIZE`` counts those: a
    receiver that allowed exactly its frame size dropped such a frame and the connection with it,
    so the write stayed pending (its last frame carries the answer) while a later write, sent after
    the reconnect, completed. Counted, not timed: the small write sent second must not finish
    before the large one."""
    import secrets as random_bytes

    import torch

    from splitserve.disagg.control.curve import ClusterSecret
    from splitserve.disagg.transfer import Span
    from splitserve.disagg.transfer.tcp import TcpBackend

    secret = ClusterSecret(random_bytes.token_bytes(32)) if secured else None
    frame = 4 << 20
    src = torch.randint(0, 256, (3 * frame,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    dst = torch.zeros(3 * frame, dtype=torch.uint8)
    tag = random_bytes.token_hex(4)
    writer = TcpBackend(f"p-{tag}", src, secret=secret)
    receiver = TcpBackend(f"d-{tag}", dst, secret=secret)
    try:
        assert writer.max_frame_bytes == receiver.max_frame_bytes == frame  # the defaults, as the workers run
        writer.add_peer(receiver.agent_name, receiver.metadata())
        large = writer.write(receiver.agent_name, [Span(0, 0, frame), Span(frame, frame, frame + 4096)], b"large")
        small = writer.write(receiver.agent_name, [Span(2 * frame + 8192, 2 * frame + 8192, 4096)], b"small")
        deadline = time.monotonic() + 120  # a bound on a hang only: the order is what is checked
        while writer.poll(small).pending and time.monotonic() < deadline:
            time.sleep(0.005)
        assert writer.poll(small).done, writer.poll(small)
        assert writer.poll(large).done, f"the large write is {writer.poll(large)} after the later small one landed"
        assert torch.equal(dst[: 2 * frame + 4096], src[: 2 * frame + 4096])
        assert receiver.stats()["bad_frames"] == 0
        assert [n for _, n in receiver.notifications()] == [b"large", b"small"]
    finally:
        writer.close()
        receiver.close()


@pytest.mark.parametrize("secured", [True, False], ids=["curve", "plain"])
def test_a_prefill_that_closes_every_handshake_is_named_at_once(secured):
    """Decode's side of a refused handshake when the refusal itself is lost: a prefill with a
    secret meeting a decode without one closes the connection at once, and on a busy machine the
    reset that close sends often discards the greeting that named the mismatch (the decode then
    waited out its 45 s bootstrap deadline). Played here by a port that resets every connection:
    a decode with a secret or without one names authentication after two such closes."""
    import secrets as random_bytes

    from splitserve.disagg.control.curve import ClusterSecret
    from splitserve.disagg.control.decode_client import ZmqDealer

    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def reset_every_connection():
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset, not a FIN
            conn.close()

    resetter = threading.Thread(target=reset_every_connection, daemon=True)
    resetter.start()
    secret = ClusterSecret(random_bytes.token_bytes(32)) if secured else None
    dealer = ZmqDealer(f"127.0.0.1:{listener.getsockname()[1]}", b"d-" + random_bytes.token_bytes(4), secret)
    try:
        deadline, refused = time.monotonic() + ARRIVE_S, None
        while refused is None and time.monotonic() < deadline:
            refused = dealer.auth_failure()
            time.sleep(0.01)
        assert refused is not None and "authentication failed" in refused, "the refusal was never named"
    finally:
        dealer.close()
        stop.set()
        resetter.join(5)
        listener.close()


@pytest.mark.parametrize("secured", [True, False], ids=["curve", "plain"])
def test_a_control_frame_of_the_largest_size_crosses_both_ways_under_the_secret(secured):
    """The control plane's sibling of the tcp write above: its sockets take frames up to
    ``MAX_FRAME_BYTES`` (protocol.decode's limit), and with the cluster secret their ``MAXMSGSIZE``
    must allow CURVE's 33 bytes a frame on top, or a frame of the largest size is dropped with its
    connection. Counted: the largest frame arrives before the small one sent after it, both ways."""
    import secrets as random_bytes

    from splitserve.disagg import protocol as p
    from splitserve.disagg.control.curve import ClusterSecret
    from splitserve.disagg.control.decode_client import ZmqDealer
    from splitserve.disagg.control.prefill_server import ZmqRouterEndpoint

    secret = ClusterSecret(random_bytes.token_bytes(32)) if secured else None
    port = free_port()
    endpoint = ZmqRouterEndpoint("127.0.0.1", port, secret)
    dealer = ZmqDealer(f"127.0.0.1:{port}", b"d-" + random_bytes.token_bytes(4), secret)
    largest = random_bytes.token_bytes(p.MAX_FRAME_BYTES)

    def take(recv, n):
        got, deadline = [], time.monotonic() + 60  # a bound on a hang only: the order is what is checked
        while len(got) < n and time.monotonic() < deadline:
            frame = recv()
            if frame is None:
                time.sleep(0.005)
            else:
                got.append(frame)
        return got

    try:
        dealer.send(largest)
        dealer.send(b"small")
        got = take(endpoint.recv, 2)
        assert [f[-1] for f in got] == [largest, b"small"], [len(f[-1]) for f in got]
        ident = got[0][0]
        endpoint.send(ident, largest)
        endpoint.send(ident, b"small")
        assert take(dealer.recv, 2) == [largest, b"small"]
    finally:
        dealer.close()
        endpoint.close()
