"""Wire protocol: round trips, zero-copy arrays, malformed frames dropped and counted, CURVE."""

from __future__ import annotations

import os
import time

import msgspec
import numpy as np
import pytest
import zmq

from hetero_spec.transport.channel import Channel, CurveKeys, ServerContext, check_bind_host
from hetero_spec.transport.protocol import (COPY_THRESHOLD, Begin, MalformedMessage, Ping, Proposal, Sync,
                                            decode, encode)
from tests.fixtures.fuzz import fuzz_frames


def _frames(frames):
    return [f.tobytes() if isinstance(f, np.ndarray) else f for f in frames]


def test_round_trip_with_arrays():
    msg = Proposal(req_id=1, epoch=2, base=10, start=12, draft_s=0.001, draft_t0=1.0, sent=2.0)
    ids = np.array([5, 6, 7], dtype=np.int32)
    probs = np.random.default_rng(0).random((3, 50)).astype(np.float32)
    got, arrays = decode(_frames(encode(msg, (ids, probs))))
    assert got == msg
    np.testing.assert_array_equal(arrays[0], ids)
    np.testing.assert_array_equal(arrays[1], probs)


@pytest.mark.parametrize("frames, why", [
    ([], "empty"),
    ([b"\x00not msgpack"], "bad header"),
    ([msgspec.msgpack.encode({"t": "nosuch"})], "bad header"),
    ([msgspec.msgpack.encode({"t": "ping"})], "bad header"),  # missing fields
    ([msgspec.msgpack.encode({"t": "sync", "req_id": 1, "pos": 0, "epoch": 0,
                              "arrays": [{"dtype": "int32", "shape": [4]}]})], "frames"),
    ([msgspec.msgpack.encode({"t": "sync", "req_id": 1, "pos": 0, "epoch": 0,
                              "arrays": [{"dtype": "int32", "shape": [4]}]}), b"123"], "does not match"),
    ([msgspec.msgpack.encode({"t": "sync", "req_id": 1, "pos": 0, "epoch": 0,
                              "arrays": [{"dtype": "object", "shape": [1]}]}), b"1234"], "bad array meta"),
])
def test_malformed_messages_raise(frames, why):
    with pytest.raises(MalformedMessage, match=why):
        decode(frames)


def test_no_pickle_types_on_the_wire():
    with pytest.raises(TypeError):
        encode(Sync(req_id=1, pos=0, epoch=0), (np.array([object()]),))


@pytest.fixture()
def server():
    srv = ServerContext()
    yield srv
    srv.close()


def test_channel_drops_and_counts_garbage_then_continues(server):
    a = Channel.bind(server, "ipc")
    b = Channel.connect(a.endpoint)
    try:
        b.sock.send_multipart([b"garbage"])
        b.sock.send_multipart([b"\x81\xa1t\xa4ping", b"extra"])
        b.send(Ping(seq=3, sent=0.0))
        msg, _ = a.recv(30.0)
        assert isinstance(msg, Ping) and msg.seq == 3
        assert a.dropped == 2
        assert a.recv(0.0) is None
    finally:
        a.close()
        b.close()


def test_fuzz_1000_malformed_frames_on_a_real_socket(server):
    a = Channel.bind(server, "ipc")
    raw = zmq.Context.instance().socket(zmq.PAIR)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(a.endpoint)
    try:
        frames = fuzz_frames(1000, req_id=1, vocab=384, semantic=False)
        for f in frames:
            raw.send_multipart(f)
        raw.send_multipart(encode(Ping(seq=9, sent=0.0)))
        msg, _ = a.recv(30.0)
        assert isinstance(msg, Ping) and msg.seq == 9
        assert a.dropped == 1000 and a.received == 1
    finally:
        raw.close(linger=0)
        a.close()


def test_decode_bounds_shapes_before_allocating():
    head = msgspec.msgpack.encode({"t": "sync", "req_id": 1, "pos": 0, "epoch": 0,
                                   "arrays": [{"dtype": "int32", "shape": [2 ** 62]}]})
    with pytest.raises(MalformedMessage, match="dimensions"):
        decode([head, b""])
    two_d = msgspec.msgpack.encode({"t": "sync", "req_id": 1, "pos": 0, "epoch": 0,
                                    "arrays": [{"dtype": "int32", "shape": [2, 2]}]})
    with pytest.raises(MalformedMessage, match="1-D"):
        decode([two_d, b"\x00" * 16])
    with pytest.raises(MalformedMessage, match="carries"):
        decode(_frames(encode(Ping(seq=1, sent=0.0), (np.zeros(2, np.int32),))))


def test_frames_above_maxmsgsize_are_refused(server):
    a = Channel.bind(server, "ipc", max_msg_bytes=1024)
    raw = zmq.Context.instance().socket(zmq.PAIR)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(a.endpoint)
    try:
        raw.send_multipart(encode(Sync(req_id=1, pos=0, epoch=0), (np.zeros(4096, np.int32),)))
        # libzmq drops the oversized message and the connection; the peer reconnects by itself
        deadline = time.monotonic() + 30
        got = None
        while got is None and time.monotonic() < deadline:
            raw.send_multipart(encode(Ping(seq=5, sent=0.0)), flags=zmq.NOBLOCK) if raw.poll(0, zmq.POLLOUT) else None
            got = a.recv(0.2)
        assert got is not None and isinstance(got[0], Ping)
    finally:
        raw.close(linger=0)
        a.close()


def test_large_arrays_zero_copy_path(server):
    a = Channel.bind(server, "ipc")
    b = Channel.connect(a.endpoint)
    try:
        big = np.arange(COPY_THRESHOLD, dtype=np.int32)
        b.send(Begin(req_id=1, temperature=1.0, top_k=0, top_p=1.0, seed=0, gamma=4, max_ahead=8), big)
        msg, arrays = a.recv(30.0)
        np.testing.assert_array_equal(arrays[0], big)
    finally:
        a.close()
        b.close()


def test_closed_channel_neither_sends_nor_raises(server):
    a = Channel.bind(server, "ipc")
    a.close()
    assert a.send(Ping(seq=1, sent=0.0)) is False and a.recv(0.01) is None and not a.poll()


def test_tcp_beyond_loopback_needs_configured_keys():
    assert check_bind_host("127.0.0.1", keys_configured=False) is None
    assert "curve_keys" in check_bind_host("0.0.0.0", keys_configured=False)
    assert check_bind_host("0.0.0.0", keys_configured=True) is None


def test_tcp_channel_requires_curve(server):
    with pytest.raises(ValueError, match="CURVE"):
        Channel.bind(server, "tcp")


def _client_keys(keys: CurveKeys, server_public: bytes | None = None) -> dict:
    return {"server_public": (server_public or keys.server_public).decode(), "public": keys.client_public.decode(),
            "secret": keys.client_secret.decode()}


def test_curve_admits_the_paired_client(server):
    keys = CurveKeys.generate()
    a = Channel.bind(server, "tcp", curve=keys)
    b = Channel.connect(a.endpoint, curve=_client_keys(keys))
    try:
        b.send(Ping(seq=1, sent=0.0))
        msg, _ = a.recv(30.0)
        assert isinstance(msg, Ping) and msg.seq == 1
    finally:
        a.close()
        b.close()


def test_curve_rejects_other_clients(server):
    keys = CurveKeys.generate()
    a = Channel.bind(server, "tcp", curve=keys)
    other = CurveKeys.generate()
    intruder = Channel.connect(a.endpoint, curve=_client_keys(other, server_public=keys.server_public))
    plain = zmq.Context.instance().socket(zmq.PAIR)
    plain.setsockopt(zmq.LINGER, 0)
    try:
        intruder.send(Ping(seq=2, sent=0.0))
        assert a.recv(1.0) is None  # unknown client key: ZAP refuses the handshake
        intruder.close()
        plain.connect(a.endpoint)
        try:
            plain.send_multipart(encode(Ping(seq=3, sent=0.0)), flags=zmq.NOBLOCK)
        except zmq.Again:  # no handshake, no pipe: nothing can even be queued
            pass
        assert a.recv(1.0) is None  # no CURVE at all: refused
        # the paired client still gets in on the same socket
        b = Channel.connect(a.endpoint, curve=_client_keys(keys))
        b.send(Ping(seq=4, sent=0.0))
        msg, _ = a.recv(30.0)
        assert msg.seq == 4
        b.close()
    finally:
        plain.close()
        a.close()


def test_two_authenticators_in_one_process_and_100_rebind_cycles():
    """Each engine's context has its own ZAP authenticator: two at once do not collide, and closing then
    re-binding at once never finds the fixed inproc address still taken."""
    keys = CurveKeys.generate()
    s1, s2 = ServerContext(), ServerContext()
    try:
        a1 = Channel.bind(s1, "tcp", curve=keys)
        a2 = Channel.bind(s2, "tcp", curve=keys)
        assert a1.endpoint != a2.endpoint
    finally:
        s1.close()
        s2.close()
    for i in range(100):
        srv = ServerContext()
        try:
            a = Channel.bind(srv, "tcp", curve=keys)
            if i % 20 == 0:  # a real handshake now and then
                b = Channel.connect(a.endpoint, curve=_client_keys(keys))
                b.send(Ping(seq=i, sent=0.0))
                assert a.recv(30.0)[0].seq == i
                b.close()
            a.close()
        finally:
            srv.close()
        assert not os.path.exists(srv.dir)


def test_server_context_dir_is_private_and_removed(server):
    assert os.stat(server.dir).st_mode & 0o777 == 0o700
    a = Channel.bind(server, "ipc", name="w7")
    assert a.endpoint == f"ipc://{server.dir}/w7.sock"
    a.close()
    assert not os.path.exists(f"{server.dir}/w7.sock")
