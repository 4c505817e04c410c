"""p2p-diloco: Decoupled DiLoCo over a hivemind DHT, with no central coordinator."""

__version__ = "0.1.0"
