"""Requests to hivemind's DHT and averager processes arrive whole (p2p_diloco/net/dht.py, _WholeMessages).

uvloop's add_reader leaves the child's end of the request pipe non-blocking; multiprocessing then loses
the part of a message it read before the rest arrived, and the process dies on the next read.
"""

import multiprocessing as mp
import os
import threading
import time

from hivemind.utils import get_dht_time

from p2p_diloco.net.dht import _WholeMessages, read_whole_messages, start_dht

BIG = 1 << 20  # 16 times a Linux pipe's buffer: the sender writes it in many pieces


def _send_all(conn, count: int) -> None:
    for i in range(count):
        conn.send((i, bytes([i % 256]) * BIG))


def test_a_non_blocking_reader_gets_every_message_whole_while_the_sender_is_still_writing():
    reader, writer = mp.Pipe(duplex=False)
    os.set_blocking(reader.fileno(), False)  # what uvloop's add_reader does to hivemind's pipe
    whole = _WholeMessages(reader)
    sender = threading.Thread(target=_send_all, args=(writer, 12), daemon=True)
    sender.start()
    got = []
    while len(got) < 12:
        if whole.poll(10):
            got.append(whole.recv())
    sender.join(10)
    assert [i for i, _ in got] == list(range(12))
    assert all(len(body) == BIG and body[:1] == body[-1:] == bytes([i % 256]) for i, body in got)
    assert not os.get_blocking(reader.fileno())  # left as the event loop expects it


def test_wrapping_is_done_once_and_everything_else_is_the_pipes_own():
    reader, writer = mp.Pipe(duplex=True)

    class Component:
        _inner_pipe = reader

    component = Component()
    read_whole_messages(component)
    read_whole_messages(component)
    assert isinstance(component._inner_pipe, _WholeMessages)
    assert not isinstance(component._inner_pipe._conn, _WholeMessages)
    assert component._inner_pipe.fileno() == reader.fileno()
    component._inner_pipe.send("hello")
    assert writer.recv() == "hello"


def test_a_dht_process_survives_large_requests_from_several_threads():
    """4 threads storing 300 kB values at once: before whole-message reads, the DHT process died
    (BlockingIOError, then "EOFError: Ran out of input") and the senders hung on the full pipe."""
    dht = start_dht(initial_peers=[], host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[],
                              identity_path=None, startup_timeout=30)
    threads: list[threading.Thread] = []
    try:
        value, errors = b"x" * 300_000, []

        def store(t: int) -> None:
            try:
                for i in range(25):
                    assert dht.store(f"key-{t}-{i}", value, get_dht_time() + 60)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(repr(e))

        threads += [threading.Thread(target=store, args=(t,), daemon=True) for t in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in threads), "a sender hung: the DHT process stopped reading"
        assert errors == []
        assert dht.is_alive()
        assert dht.get("key-3-24") is not None
    finally:
        if any(t.is_alive() for t in threads):  # its pipe is full: a shutdown request would hang too
            dht.terminate()
            dht.join(10)
        else:
            dht.shutdown()
