"""Wire protocol: round trips, zero-copy arrays, malformed frames dropped and counted, CURVE."""

from __future__ import annotations

import os
import time

import msgspec
import numpy as np
import pytest
import zmq

from hetero_spec.transport.channel import Channel, CurveKeys, check_bind_host
from hetero_spec.transport.protocol import (COPY_THRESHOLD, Begin, MalformedMessage, Ping, Proposal, Sync,
                                            decode, encode)


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


def test_channel_drops_and_counts_garbage_then_continues():
    a = Channel.bind("ipc")
    b = Channel.connect(a.endpoint)
    try:
        b.sock.send_multipart([b"garbage"])
        b.sock.send_multipart([b"\x81\xa1t\xa4ping", b"extra"])
        b.send(Ping(seq=3, sent=0.0))
        msg, _ = a.recv(2.0)
        assert isinstance(msg, Ping) and msg.seq == 3
        assert a.dropped == 2
        assert a.recv(0.05) is None
    finally:
        a.close()
        b.close()


def test_large_arrays_zero_copy_path():
    a = Channel.bind("ipc")
    b = Channel.connect(a.endpoint)
    try:
        big = np.arange(COPY_THRESHOLD, dtype=np.float32).reshape(8, -1)
        b.send(Begin(req_id=1, temperature=1.0, top_k=0, top_p=1.0, seed=0, gamma=4, max_ahead=8), big)
        msg, arrays = a.recv(2.0)
        np.testing.assert_array_equal(arrays[0], big)
    finally:
        a.close()
        b.close()


def test_tcp_beyond_loopback_needs_curve():
    assert check_bind_host("127.0.0.1", curve=False) is None
    assert "CURVE" in check_bind_host("0.0.0.0", curve=False)
    assert check_bind_host("0.0.0.0", curve=True) is None


def _curve_client(endpoint, monkeypatch, server_public: bytes, client: CurveKeys) -> Channel:
    monkeypatch.setenv("HETERO_SPEC_CURVE_SERVER", server_public.decode())
    monkeypatch.setenv("HETERO_SPEC_CURVE_PUBLIC", client.client_public.decode())
    monkeypatch.setenv("HETERO_SPEC_CURVE_SECRET", client.client_secret.decode())
    return Channel.connect(endpoint)


def test_curve_admits_the_paired_client(monkeypatch):
    keys = CurveKeys.generate()
    a = Channel.bind("tcp", curve=keys)
    b = _curve_client(a.endpoint, monkeypatch, keys.server_public, keys)
    try:
        b.send(Ping(seq=1, sent=0.0))
        msg, _ = a.recv(3.0)
        assert isinstance(msg, Ping) and msg.seq == 1
    finally:
        a.close()
        b.close()


def test_curve_rejects_other_clients(monkeypatch):
    keys = CurveKeys.generate()
    a = Channel.bind("tcp", curve=keys)
    intruder = _curve_client(a.endpoint, monkeypatch, keys.server_public, CurveKeys.generate())
    plain = zmq.Context.instance().socket(zmq.PAIR)
    plain.setsockopt(zmq.LINGER, 0)
    try:
        intruder.send(Ping(seq=2, sent=0.0))
        assert a.recv(1.0) is None  # unknown client key: ZAP refuses the handshake
        intruder.close()
        plain.connect(a.endpoint)
        plain.send_multipart(encode(Ping(seq=3, sent=0.0)), flags=zmq.NOBLOCK)
        assert a.recv(1.0) is None  # no CURVE at all: refused
    except zmq.Again:
        pass
    finally:
        plain.close()
        a.close()
