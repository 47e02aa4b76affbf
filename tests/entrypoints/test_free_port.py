"""free_port gives a port a server can bind seconds later: outside the kernel's ephemeral range,
so no outgoing connection takes it in between (CI once failed with EADDRINUSE that way)."""

import socket

from jaxgen.entrypoints.mooncake_local import LOWEST_CHOSEN_PORT, ephemeral_ports, free_port


def test_free_ports_lie_below_the_ephemeral_range_and_bind():
    ephemeral = ephemeral_ports()
    assert len(ephemeral) > 1000 and ephemeral.start > LOWEST_CHOSEN_PORT
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1  # chosen at random, not one fixed port
    for port in ports:
        assert LOWEST_CHOSEN_PORT <= port < ephemeral.start
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
            s.listen()


def test_a_port_in_use_is_not_given():
    taken = []
    try:
        for _ in range(200):
            s = socket.socket()
            port = free_port()
            s.bind(("127.0.0.1", port))  # would raise if free_port gave a port in use
            taken.append(s)
    finally:
        for s in taken:
            s.close()
