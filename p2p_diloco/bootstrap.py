"""A bootstrap node: a DHT peer that does not train, with a stable identity and address.

It is only a well-known entry point. Once a learner has joined, any running learner's address works
as ``--initial-peers`` for the next one, so losing the bootstrap node stops nobody.

Its private key lives in an identity file, created on the first run and reused afterwards, so its
peer ID (the ``/p2p/...`` part of the multiaddr) survives restarts.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvloop
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from p2p_diloco.config import config_error, read_toml

if TYPE_CHECKING:  # lifecycle imports hivemind: loaded only when a node starts
    from p2p_diloco.net.dht import LinkedDHT

logger = logging.getLogger("p2p_diloco.bootstrap")


class BootstrapConfig(BaseModel):
    """Settings of a bootstrap node, from a TOML file and CLI flags (:func:`load_bootstrap_config`).

    Unknown keys are refused. ``maddrs_file``: where the node writes its visible multiaddrs, one a line;
    ``refresh_period``: seconds between two log lines with the routing table's size.
    """
    model_config = ConfigDict(extra="forbid")

    host_maddrs: list[str] = Field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/31337"])
    announce_maddrs: list[str] = Field(default_factory=list)
    initial_peers: list[str] = Field(default_factory=list)
    identity_path: str = "bootstrap/identity.key"
    allowed_peers: str | None = None  # a private swarm's allow-list (trust.admission); it must name this node
    maddrs_file: str | None = None
    refresh_period: float = Field(30.0, gt=0.0)
    startup_timeout: float = Field(60.0, gt=0.0)


def load_bootstrap_config(path: str | None, overrides: dict[str, Any]) -> BootstrapConfig:
    """Read ``path`` (TOML; None: defaults), apply the CLI's non-None ``overrides``, validate (ConfigError)."""
    data = read_toml(path) if path else {}
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return BootstrapConfig.model_validate(data)
    except ValidationError as e:
        raise config_error(e) from None


@dataclass
class BootstrapNode:
    """Runs a started DHT node as the swarm's entry point until ``stop`` is set (SIGINT or SIGTERM)."""
    cfg: BootstrapConfig
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def serve(self, dht: LinkedDHT) -> None:
        """Log the node's multiaddrs (and write them to ``maddrs_file``), then wait for ``stop``; shuts ``dht`` down.

        Installs SIGINT and SIGTERM handlers on the running loop; the file is replaced atomically.
        """
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stop.set)
        try:
            maddrs = [str(a) for a in dht.get_visible_maddrs()]
            logger.info(f"bootstrap node {dht.peer_id} is up; give learners one of:")
            for a in maddrs:
                logger.info(f"  --initial-peers {a}")
            if self.cfg.maddrs_file:
                path = Path(self.cfg.maddrs_file)
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                tmp.write_text("\n".join(maddrs) + "\n")
                tmp.replace(path)
            while not self.stop.is_set():
                try:
                    await asyncio.wait_for(self.stop.wait(), timeout=self.cfg.refresh_period)
                except TimeoutError:
                    n = await loop.run_in_executor(None, _routing_table_size, dht)
                    logger.info(f"{n} other DHT peers in the routing table")
            logger.info("shutting down the bootstrap node")
        finally:
            await loop.run_in_executor(None, dht.shutdown)


async def _count_peers(_dht: Any, node: Any) -> int:
    return len(node.protocol.routing_table.uid_to_peer_id)


def _routing_table_size(dht: LinkedDHT) -> int:
    return dht.run_coroutine(_count_peers)


def start_bootstrap_dht(cfg: BootstrapConfig) -> LinkedDHT:
    """Start the node's DHT (on the main thread) with its identity file and allow-list; LearnerError (or
    ConfigError for a bad allow-list) if it cannot."""
    from p2p_diloco.net.dht import start_dht
    from p2p_diloco.trust.admission import Admission, admit_self, peer_id_of
    from p2p_diloco.trust.signed_records import IdentityKey

    admission = Admission.from_file(cfg.allowed_peers)
    Path(cfg.identity_path).parent.mkdir(parents=True, exist_ok=True)
    peer_id_of(cfg.identity_path)  # made here if missing: its key validates signed records from the start
    admit_self(admission, cfg.identity_path)
    return start_dht(
        initial_peers=cfg.initial_peers, host_maddrs=cfg.host_maddrs, announce_maddrs=cfg.announce_maddrs,
        identity_path=cfg.identity_path, startup_timeout=cfg.startup_timeout, what="bootstrap DHT node",
        admission=admission, signing=IdentityKey.load(cfg.identity_path),
    )


def run_bootstrap(cfg: BootstrapConfig) -> None:
    """Run a bootstrap node until SIGINT or SIGTERM; it answers learners' reachability questions."""
    from p2p_diloco.net.reach import serve_checks

    dht = start_bootstrap_dht(cfg)
    serve_checks(dht)
    uvloop.run(BootstrapNode(cfg).serve(dht))
