"""What checking signed DHT records costs: hivemind's ``RSASignatureValidator`` against
:class:`p2p_diloco.trust.signed_records.CheckedOnce`, on the same records, side by side.

A DHT search returns a key's whole dictionary value: with M learners, M signed progress records (or
M declared groupmates), from each peer asked and at every poll. This times validating such a value
``--reads`` times with each validator, alternating, in one process:

    python benchmarks/record_checks.py --learners 16 --reads 200
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from p2p_diloco.net.progress_records import ProgressRecord
from p2p_diloco.trust.signed_records import CheckedOnce, owner_marker


def signed_records(learners: int) -> list[DHTRecord]:
    """One signed progress record per learner under one key, as a search returns them."""
    key, expires = DHTID.generate(source="bench_progress").to_bytes(), get_dht_time() + 600
    value = ProgressRecord(version=3, sha256="ab" * 32, tokens=10**6, versions=(3,), shas=("cd" * 32,)).encode()
    out = []
    for _ in range(learners):
        signer = RSASignatureValidator(RSAPrivateKey())
        unsigned = DHTRecord(key, MSGPackSerializer.dumps(owner_marker(signer)), value, expires)
        out.append(dataclasses.replace(unsigned, value=signer.sign_value(unsigned)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--learners", type=int, default=16, help="records in the dictionary value")
    ap.add_argument("--reads", type=int, default=200, help="times the whole value is validated, per validator")
    ap.add_argument("--rounds", type=int, default=5, help="alternations of the two validators")
    args = ap.parse_args()
    records = signed_records(args.learners)
    checkers = {"RSASignatureValidator": RSASignatureValidator(RSAPrivateKey()),
                "CheckedOnce": CheckedOnce(RSAPrivateKey())}
    times: dict[str, list[float]] = {name: [] for name in checkers}
    for _ in range(args.rounds):
        for name, checker in checkers.items():
            began = time.perf_counter()
            for _ in range(args.reads):
                if not all(checker.validate(r) for r in records):
                    raise SystemExit(f"error: {name} rejected an honest record")
            times[name].append((time.perf_counter() - began) / (args.reads * len(records)) * 1e6)
    print(f"| validator | µs per record checked (median of {args.rounds}; "
          f"{args.learners} records, {args.reads} reads) |")
    print("|---|---|")
    for name, xs in times.items():
        print(f"| {name} | {statistics.median(xs):.1f} |")
    ratio = statistics.median(times["RSASignatureValidator"]) / statistics.median(times["CheckedOnce"])
    print(f"\nCheckedOnce is {ratio:.0f}x cheaper per record read again")


if __name__ == "__main__":
    main()
