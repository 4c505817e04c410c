"""Shape one interface's egress with the simulator's recipe; used by the Docker gateways.

    python -m p2p_diloco.sim.regions.shape --dev eth1 --rate 20mbit --delay-ms 40 --loss-pct 0.1

Delay and loss need the ``netem`` qdisc. Where the kernel lacks it, this says so on one line and
shapes bandwidth only (tbf), exactly as ``p2p-diloco regions`` does.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from p2p_diloco.config import ConfigError
from p2p_diloco.sim.regions.netns import sh, shape, shape_commands
from p2p_diloco.sim.regions.topology import rate_bits_per_second


def main(argv: list[str] | None = None) -> int:
    """Replace ``--dev``'s root qdisc with the shaping recipe (bandwidth only where netem is missing).

    Returns 2 for a malformed rate or when ``tc`` refuses the shaping.
    """
    p = argparse.ArgumentParser(prog="python -m p2p_diloco.sim.regions.shape", description=__doc__.splitlines()[0])
    p.add_argument("--dev", required=True)
    p.add_argument("--rate", required=True, help="tc units, e.g. 20mbit")
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--loss-pct", type=float, default=0.0)
    a = p.parse_args(argv)
    try:
        rate_bits_per_second(a.rate)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    subprocess.run(["tc", "qdisc", "del", "dev", a.dev, "root"], capture_output=True)  # idempotent on restart
    netem = a.delay_ms > 0 or a.loss_pct > 0
    if netem:
        probe = shape_commands(a.dev, a.rate, a.delay_ms, a.loss_pct, netem=True)[0]
        if subprocess.run(["tc", *probe], capture_output=True).returncode != 0:
            print(f"shape: no netem qdisc in this kernel: delay {a.delay_ms:g} ms and loss {a.loss_pct:g} % "
                  f"are NOT applied on {a.dev}; shaping bandwidth only (tbf {a.rate})", flush=True)
            netem = False
        else:
            sh("tc", "qdisc", "del", "dev", a.dev, "root")
    try:
        shape(None, a.dev, a.rate, a.delay_ms, a.loss_pct, netem)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"shape: {a.dev} egress: {a.rate}" + (f", delay {a.delay_ms:g} ms, loss {a.loss_pct:g} %" if netem else ""),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
