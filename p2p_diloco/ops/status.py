"""``p2p-diloco status``: the swarm as one table, read from the DHT by a light client.

The client joins the DHT in client mode (it stores nothing for others, trains nothing, publishes no
record, so no learner counts it), reads the run's lineage index (``{run_id}_lineages``: each learner
names its lineage there, :class:`~p2p_diloco.net.progress_records.LineageIndex`), then each lineage's signed progress
records. :func:`swarm_document` turns those records into one JSON-able document (what ``--json`` prints);
:func:`render` draws it with rich.

Example::

    p2p-diloco status --initial-peers /ip4/203.0.113.7/tcp/31337/p2p/12D3KooW... --watch
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from p2p_diloco.net.progress_records import ProgressRecord

_NO_STATE = "0" * 64  # the sha of a record announced before its learner holds a state
MAX_LINEAGES = 16


def swarm_document(run_id: str, lineages: Mapping[str, Mapping[str, ProgressRecord]],
                   now: float | None = None) -> dict[str, Any]:
    """The swarm as one JSON-able document: per lineage, its learners (newest version first), totals, and per
    fragment whether the live learners at its newest version hold the same state (``agree``)."""
    now = time.time() if now is None else now
    out: dict[str, Any] = {"run_id": run_id, "time": now, "lineages": {}}
    for lineage, records in sorted(lineages.items()):
        merged = max((r.tokens / max(1, len(r.versions)) for r in records.values()), default=0.0)
        learners = []
        for peer, r in sorted(records.items(), key=lambda pr: (-pr[1].version, pr[0])):
            learners.append({
                "peer_id": peer, "status": r.status, "version": r.version, "versions": list(r.versions),
                "sha256": r.sha256, "shas": list(r.shas), "device_kind": r.device_kind, "device_name": r.device_name,
                "workers": r.workers, "cpu_cores": r.cpu_cores, "tokens_per_second": r.tokens_per_second,
                "tokens_contributed": r.tokens_contributed,
                "share": r.tokens_contributed / merged if merged > 0 else 0.0,
                "bytes_sent": r.bytes_sent, "bytes_received": r.bytes_received, "uptime": r.uptime,
                "eval_loss": r.eval_loss, "age": max(0.0, now - r.wall_time), "reach": r.reach, "address": r.address,
                "excluded": [list(e) for e in r.excluded], "heals": r.heals,
                "loss_rises": r.loss_rises,
            })
        live = [r for r in records.values() if r.status != "left" and r.sha256 != _NO_STATE]
        fragments = []
        for f in range(max((len(r.versions) for r in live), default=0)):
            newest = max(r.fragment_version(f) for r in live)
            shas = {r.fragment_sha(f) for r in live if r.fragment_version(f) == newest}
            fragments.append({"fragment": f, "version": newest, "agree": len(shas) == 1,
                              "learners_at_version": sum(r.fragment_version(f) == newest for r in live)})
        out["lineages"][lineage] = {
            "learners": learners, "fragments": fragments, "alerts": _alerts(records),
            "totals": {"learners": len(records), "live": len(live), "merged_tokens": round(merged),
                       "tokens_per_second": sum(r.tokens_per_second for r in live),
                       "tokens_contributed": sum(r.tokens_contributed for r in records.values()),
                       "bytes_sent": sum(r.bytes_sent for r in records.values()),
                       "bytes_received": sum(r.bytes_received for r in records.values())},
        }
    return out


def _alerts(records: Mapping[str, ProgressRecord]) -> list[str]:
    """What the learners' records say went wrong: peers their recent rounds left out (most reported first, with
    who reported them), learners whose own training diverged, and learners whose eval loss rose sharply."""
    reporters: dict[str, list[str]] = {}
    for peer, r in records.items():
        for excluded, rounds in r.excluded:
            reporters.setdefault(excluded, []).append(f"{peer[-8:]} ({rounds})")
    out = [f"{excluded} left out of recent rounds by {len(by)} learner(s): {', '.join(sorted(by))}"
           for excluded, by in sorted(reporters.items(), key=lambda eb: (-len(eb[1]), eb[0]))]
    out += [f"{peer[-8:]} diverged and took the global state back {r.heals} time(s)"
            for peer, r in sorted(records.items()) if r.heals]
    out += [f"{peer[-8:]} saw its eval loss rise sharply after a round {r.loss_rises} time(s)"
            for peer, r in sorted(records.items()) if r.loss_rises]
    return out


def render(doc: Mapping[str, Any]) -> Group:
    """The document as rich tables, one per lineage, each with its totals and agreement below it."""
    parts: list[Any] = []
    if not doc["lineages"]:
        parts.append(Text(f"run {doc['run_id']}: no learners found (yet)", style="yellow"))
    for lineage, lin in doc["lineages"].items():
        table = Table(title=f"run {doc['run_id']} · lineage {lineage}", title_justify="left")
        numbers = ("tokens/s", "contributed", "share", "MB sent/recv", "eval loss", "age")
        for col in ("learner", "status", "reach", "address", "hardware", "versions", "sha", *numbers):
            table.add_column(col, justify="right" if col in numbers else "left")
        for row in lin["learners"]:
            hardware = f"{row['device_name'] or row['device_kind'] or '?'}"
            hardware += f" ×{row['workers']}" if row["workers"] > 1 else ""
            hardware += f", {row['cpu_cores']} cores" if row["cpu_cores"] else ""
            loss, versions = row["eval_loss"], "/".join(map(str, row["versions"])) or str(row["version"])
            table.add_row(
                row["peer_id"][-8:], row["status"], row["reach"] or "?", _host(row["address"]), hardware, versions,
                row["sha256"][:8], f"{row['tokens_per_second']:,.0f}", f"{row['tokens_contributed']:,}",
                f"{row['share']:.0%}", f"{row['bytes_sent'] / 1e6:,.1f}/{row['bytes_received'] / 1e6:,.1f}",
                "-" if loss is None else f"{loss:.4f}", f"{row['age']:.0f}s",
            )
        parts.append(table)
        t = lin["totals"]
        agree = ", ".join(f"fragment {fr['fragment']} v{fr['version']} "
                          f"{'agree' if fr['agree'] else 'DISAGREE'} ({fr['learners_at_version']})"
                          for fr in lin["fragments"]) or "no states yet"
        parts.append(Text(f"{t['live']} live of {t['learners']} learners · {t['tokens_per_second']:,.0f} tokens/s · "
                          f"{t['merged_tokens']:,} tokens merged · {t['bytes_sent'] / 1e6:,.1f} MB sent · "
                          f"{t['bytes_received'] / 1e6:,.1f} MB received · {agree}"))
        for alert in lin.get("alerts", []):
            parts.append(Text(f"alert: {alert}", style="bold red"))
    return Group(*parts)


def _host(address: str) -> Text:
    """An address for the table: without its /p2p/ suffix (the learner column names the peer); "?" if unknown.
    A Text cell: rich reads no markup in it (the address is what a peer says)."""
    return Text(address.split("/p2p/")[0] or "?")


def read_swarm(dht: Any, run_id: str) -> dict[str, dict[str, ProgressRecord]]:
    """Every lineage of ``run_id`` named in its index, with that lineage's progress records."""
    from p2p_diloco.net.progress_records import LineageIndex, ProgressBoard

    named = Counter(LineageIndex(dht, run_id, ttl=0.0).read().values())
    # Bounded: anyone may sign an index record, so at most the MAX_LINEAGES most named lineages are looked up.
    return {lin: ProgressBoard(dht, lin, 0.0, b"").read() for lin, _ in named.most_common(MAX_LINEAGES)}


def run_status(initial_peers: Sequence[str], run_id: str, watch: bool = False, as_json: bool = False,
               interval: float = 5.0, identity: str | None = None, timeout: float = 60.0) -> int:
    """Join the DHT as a client, print the swarm once (or refresh it in place until Ctrl+C); returns 0."""
    for handler in logging.getLogger().handlers:  # keep stdout for the table or the JSON document
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(sys.stderr)
    from p2p_diloco.net.dht import start_dht
    from p2p_diloco.trust.admission import peer_id_of
    from p2p_diloco.trust.signed_records import IdentityKey

    with tempfile.TemporaryDirectory(prefix="p2p-diloco-status-") as tmp:
        key = Path(identity) if identity else Path(tmp) / "identity.key"
        peer_id_of(key)  # made if missing: hivemind's validators strip (and check) the records' signatures with it
        dht = start_dht(initial_peers=initial_peers, host_maddrs=["/ip4/0.0.0.0/tcp/0"], announce_maddrs=[],
                        identity_path=key, startup_timeout=timeout, what="DHT (as a status client)",
                        signing=IdentityKey.load(key),
                        client_mode=True)
        try:
            return _show(dht, run_id, watch, as_json, interval)
        except KeyboardInterrupt:
            return 0
        finally:
            dht.shutdown()


def _show(dht: Any, run_id: str, watch: bool, as_json: bool, interval: float) -> int:
    def doc() -> dict[str, Any]:
        return swarm_document(run_id, read_swarm(dht, run_id))

    console = Console()
    if not watch:
        if as_json:
            print(json.dumps(doc()), flush=True)
        else:
            console.print(render(doc()))
        return 0
    if as_json:  # one document a line
        while True:
            print(json.dumps(doc()), flush=True)
            time.sleep(interval)
    from rich.live import Live

    with Live(render(doc()), console=console, auto_refresh=False) as live:
        while True:
            time.sleep(interval)
            live.update(render(doc()), refresh=True)
