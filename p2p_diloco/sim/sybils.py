"""Fresh identities of one attacker, from one address: records that say they train, and nothing else.

A test-only peer for the Sybil defence (docs/security.md, "Identities that cost something"). It joins the
swarm's DHT as one node (one p2pd, one address), makes ``--identities`` RSA keys, finds the run's lineages
through the lineage index, and every few seconds publishes, under each key, a progress record signed by that
key that copies the newest honest learner's (status training, the same versions and hashes, reach "client":
it serves nothing, so nobody downloads from it). None of these identities ever joins a round. Counted as
learners, they raise the majority quorum: 3 honest learners and 4 such keys need groups of 4, which the 3
never form, and the swarm stalls.

Run it (a bootstrap node at ADDR, a run id RUN)::

    python -m p2p_diloco.sim.sybils --initial-peers ADDR --run-id RUN --identities 4 --seconds 120

``--from-version N`` waits until an honest learner's record shows version N before it announces the keys.

It stops on SIGTERM or Ctrl+C or after ``--seconds``, and its DHT process and p2pd with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import threading
import time
from collections.abc import Sequence

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from p2p_diloco.net.progress_records import LineageIndex, ProgressRecord, RecordError, progress_key
from p2p_diloco.trust.signed_records import OwnedRecords, peer_id_of_owner

logger = logging.getLogger("p2p_diloco.sim.sybils")


class ManyKeys(RSASignatureValidator):
    """hivemind's record signer for several identities in one DHT node: a record whose subkey holds one of
    our keys' owner markers is signed with that key (hivemind's validator signs with one key only)."""

    def __init__(self, keys: Sequence[RSAPrivateKey]):
        super().__init__(keys[0])
        self._signers = [RSASignatureValidator(k) for k in keys]

    @property
    def markers(self) -> list[bytes]:
        return [s.local_public_key for s in self._signers]

    def sign_value(self, record: DHTRecord) -> bytes:
        for signer in self._signers:
            if signer.local_public_key in record.subkey:
                return signer.sign_value(record)
        return record.value


def newest_honest(records: dict[str, bytes], ours: set[str]) -> ProgressRecord | None:
    """The newest training record among ``records`` (peer → raw value) that is not one of ``ours``."""
    best = None
    for peer, raw in records.items():
        if peer in ours:
            continue
        try:
            record = ProgressRecord.decode(raw)
        except RecordError:
            continue
        if record.status == "training" and (best is None or record.version > best.version):
            best = record
    return best


def run(initial_peers: Sequence[str], run_id: str, identities: int, seconds: float, ttl: float,
        host: str = "/ip4/127.0.0.1/tcp/0", from_version: int = 0) -> int:
    """Publish the identities' records until ``seconds`` pass or a signal comes, once the newest honest record
    reached ``from_version``; how many records were stored."""
    from p2p_diloco.net.dht import LinkedDHT

    keys = [RSAPrivateKey() for _ in range(identities)]
    signer = ManyKeys(keys)
    dht = LinkedDHT(initial_peers=list(initial_peers), host_maddrs=[host], start=True, await_ready=True,
                    record_validators=[signer, OwnedRecords()], owner=signer.markers[0])
    ids = {str(peer_id_of_owner(m)) for m in signer.markers}
    logger.info(f"{identities} identities from one DHT node: {', '.join(sorted(p[-6:] for p in ids))}")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stored, until = 0, time.monotonic() + seconds
    try:
        while not stop.is_set() and time.monotonic() < until:
            for lineage in set(LineageIndex(dht, run_id, ttl).read().values()):
                key = progress_key(lineage)
                found = dht.get(key, latest=True)
                entries = found.value if found is not None and isinstance(found.value, dict) else {}
                raw = {str(p): item.value for sub, item in entries.items()
                       if (p := peer_id_of_owner(sub)) is not None}
                honest = newest_honest(raw, ids)
                if honest is None or honest.version < from_version:
                    continue
                record = dataclasses.replace(honest, wall_time=time.time(), reach="client", address="",
                                             tokens_per_second=0.0, tokens_contributed=0, excluded=(), heals=0)
                for marker in signer.markers:
                    stored += bool(dht.store(key, record.encode(), get_dht_time() + ttl, subkey=marker))
            stop.wait(ttl / 3)
    finally:
        dht.shutdown()
    logger.info(f"stored {stored} records")
    return stored


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--initial-peers", nargs="+", required=True, help="the swarm's bootstrap multiaddr(s)")
    parser.add_argument("--run-id", default="p2p-diloco", help="the run whose lineages to join (network.run_id)")
    parser.add_argument("--identities", type=int, default=4, help="how many fresh keys to announce")
    parser.add_argument("--seconds", type=float, default=120.0, help="how long to keep announcing them")
    parser.add_argument("--ttl", type=float, default=8.0, help="each record's lifetime (network.record_ttl)")
    parser.add_argument("--from-version", type=int, default=0,
                        help="announce the keys only once an honest learner's record shows this version")
    args = parser.parse_args(argv)
    if args.identities < 1 or args.seconds <= 0 or args.ttl <= 0 or args.from_version < 0:
        parser.error("--identities, --seconds and --ttl must be positive, --from-version at least 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s sybils: %(message)s")
    stored = run(args.initial_peers, args.run_id, args.identities, args.seconds, args.ttl,
                 from_version=args.from_version)
    return 0 if stored > 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
