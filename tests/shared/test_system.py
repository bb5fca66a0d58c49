import socket

from shared.system import _ephemeral_range, free_port


def test_free_ports_lie_below_the_ephemeral_range_and_are_never_repeated():
    low, _ = _ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(p < low for p in ports)


def test_a_free_port_can_be_bound_while_the_kernel_hands_out_its_own():
    port = free_port()
    # Many kernel-assigned ports (what outgoing connections and port-0 listeners get) never include ours.
    taken = []
    try:
        for _ in range(200):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            taken.append(s)
        assert port not in {s.getsockname()[1] for s in taken}
        with socket.socket() as ours:
            ours.bind(("127.0.0.1", port))
    finally:
        for s in taken:
            s.close()
