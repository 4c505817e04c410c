"""p2p-diloco: Decoupled DiLoCo over a hivemind DHT, with no central coordinator."""

import time

__version__ = "0.1.0"

# When this process first imported the package (before torch and hivemind): start-up logs count from here.
STARTED = time.monotonic()
