"""Two real DHTs over p2pd count the same bytes from both ends, and by kind of key (p2p_diloco/net/traffic.py)."""

import pytest
from hivemind.utils import get_dht_time

from p2p_diloco.net.dht import LinkedDHT
from p2p_diloco.net.traffic import read_key_traffic, read_traffic, totals


@pytest.mark.timeout(120)
def test_two_real_dhts_count_the_same_bytes_from_both_ends():
    a = LinkedDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    b = None
    try:
        b = LinkedDHT(start=True, initial_peers=[str(x) for x in a.get_visible_maddrs()],
                      host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        assert b.store("run_progress", b"x" * 1000, get_dht_time() + 30)
        assert a.get("run_progress", latest=True) is not None
        for _ in range(10):  # a read between two calls of a background exchange would not match: read again
            ta, tb = totals(read_traffic(a)), totals(read_traffic(b))
            if ta == totals(read_traffic(a)):
                break
        assert ta["calls_made"] == tb["calls_served"] and tb["calls_made"] == ta["calls_served"]
        assert ta["bytes_in"] == tb["bytes_out"] > 1000 and ta["bytes_out"] == tb["bytes_in"]
        # a's read of the records' key, served by b which stored it: the same bytes, counted as "progress"
        ka, kb = read_key_traffic(a)["progress"], read_key_traffic(b)["progress"]
        assert ka["finds"] >= 1 and kb["stores"] >= 1
        assert ka["bytes_in"] > 1000 and kb["bytes_out"] > 1000
    finally:
        for d in (a, b):
            if d is not None:
                d.shutdown()
