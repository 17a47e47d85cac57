"""The loopback wire proxy (tests/helpers/servers.py) leaves no socket open when it stops.

A socket it left behind is collected during some later test, and ``filterwarnings = error``
fails that test on an "unclosed transport" warning that has nothing to do with it.
"""

from __future__ import annotations

import gc
import os
import socket
import threading
import time
import warnings

import pytest
from helpers.resources import open_fds
from helpers.servers import TcpProxy

pytestmark = pytest.mark.timeout(30)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
def test_a_stopped_proxy_closes_every_connection_even_a_stuck_one() -> None:
    # An upstream that accepts and never reads: the proxy's buffer towards it stays full, and a
    # plain close() of that transport would wait for it to drain for ever.
    upstream = socket.socket()
    upstream.bind(("127.0.0.1", 0))
    upstream.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        upstream.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(upstream.accept()[0])
            except TimeoutError:
                continue

    acceptor = threading.Thread(target=accept)
    acceptor.start()
    before = open_fds()
    clients = []
    try:
        proxy = TcpProxy(f"http://127.0.0.1:{upstream.getsockname()[1]}").start()
        try:
            for _ in range(4):
                client = socket.create_connection(("127.0.0.1", proxy.port))
                client.setblocking(False)
                head = b"PUT /x HTTP/1.1\r\nHost: x\r\nContent-Length: 67108864\r\n\r\n"
                try:
                    client.send(head + b"\0" * (8 << 20))
                except BlockingIOError:
                    pass
                clients.append(client)
            # Connections accepted right before the stop included: no wait for handlers.
            extra = [socket.create_connection(("127.0.0.1", proxy.port)) for _ in range(4)]
            clients += extra
            time.sleep(0.3)
        finally:
            proxy.stop()
        for client in clients:
            client.close()
        with warnings.catch_warnings():
            warnings.simplefilter("error", ResourceWarning)
            gc.collect()  # an unclosed transport would warn here (or fail under -W error)
    finally:
        stop.set()
        acceptor.join()
        for conn in accepted:
            conn.close()
    assert open_fds() <= before, "the proxy left sockets open"
