"""`p2p-diloco status` rendering, from fake progress records."""

import json

from rich.console import Console

from p2p_diloco.net.progress_records import ProgressRecord
from p2p_diloco.ops.status import render, swarm_document

A, B = "a" * 64, "b" * 64


def _rec(versions, shas, status="training", contributed=0, **kw):
    return ProgressRecord(min(versions), shas[0], tokens=1000 * len(versions), status=status, wall_time=90.0,
                          versions=tuple(versions), shas=tuple(shas), device_kind="cpu", device_name="cpu",
                          workers=1, cpu_cores=2, tokens_per_second=500.0, tokens_contributed=contributed, **kw)


def test_document_lists_learners_totals_and_agreement():
    records = {
        "peerA": _rec([3, 3], [A, A], contributed=600, eval_loss=2.0, bytes_sent=5_000_000, bytes_received=7_000_000,
                      address="/ip4/203.0.113.7/tcp/31337/p2p/peerA"),
        "peerB": _rec([3, 2], [A, B], contributed=400, bytes_received=1_000_000),
        "peerC": _rec([1, 1], [B, B], status="left", contributed=100),
    }
    doc = swarm_document("run", {"run-1234abcd": records}, now=100.0)
    json.dumps(doc)  # JSON-able
    lin = doc["lineages"]["run-1234abcd"]
    assert [row["peer_id"] for row in lin["learners"]] == ["peerA", "peerB", "peerC"]
    a = lin["learners"][0]
    assert a["versions"] == [3, 3] and a["share"] == 0.6 and a["age"] == 10.0 and a["eval_loss"] == 2.0
    assert (a["bytes_received"], a["address"]) == (7_000_000, "/ip4/203.0.113.7/tcp/31337/p2p/peerA")
    assert (lin["totals"]["bytes_sent"], lin["totals"]["bytes_received"]) == (5_000_000, 8_000_000)
    assert lin["totals"]["learners"] == 3 and lin["totals"]["live"] == 2 and lin["totals"]["merged_tokens"] == 1000
    assert lin["totals"]["tokens_per_second"] == 1000.0
    # fragment 0: both live learners at v3 hold A; fragment 1: only peerA is at v3
    assert [(f["version"], f["agree"], f["learners_at_version"]) for f in lin["fragments"]] == [(3, True, 2),
                                                                                                (3, True, 1)]


def test_disagreement_is_reported_and_rendered():
    records = {"p1": _rec([2], [A]), "p2": _rec([2], [B])}
    doc = swarm_document("run", {"run-x": records}, now=100.0)
    assert doc["lineages"]["run-x"]["fragments"][0]["agree"] is False
    console = Console(record=True, width=200)
    console.print(render(doc))
    text = console.export_text()
    assert "DISAGREE" in text and "p1" in text and "2 live of 2 learners" in text


def test_an_empty_swarm_renders():
    console = Console(record=True, width=120)
    console.print(render(swarm_document("run", {})))
    assert "no learners found" in console.export_text()


def test_the_table_shows_address_and_traffic():
    records = {"12D3KooWpeerAAAA": _rec([2], [A], bytes_sent=2_500_000, bytes_received=4_000_000,
                                        address="/ip4/203.0.113.7/tcp/31337/p2p/12D3KooWpeerAAAA"),
               "12D3KooWpeerBBBB": _rec([2], [A], address="/ip4/[red]x[/red]/tcp/1")}
    console = Console(record=True, width=250)
    console.print(render(swarm_document("run", {"run-x": records}, now=100.0)))
    text = console.export_text()
    assert "/ip4/203.0.113.7/tcp/31337" in text and "/p2p/12D3KooWpeerAAAA" not in text  # the peer has its column
    assert "2.5/4.0" in text and "4.0 MB received" in text
    assert "/ip4/[red]x[/red]/tcp/1" in text  # a peer's text is printed as it is, never read as markup


def test_exclusions_and_heals_reported_by_the_records_become_alerts():
    records = {"12D3KooWpeerAAAA": _rec([4], [A], excluded=(("peerDDDD", 9),)),
               "12D3KooWpeerBBBB": _rec([4], [A], excluded=(("peerDDDD", 8), ("peerCCCC", 1))),
               "12D3KooWpeerCCCC": _rec([4], [A], heals=2),
               "12D3KooWpeerDDDD": _rec([4], [A], loss_rises=1)}
    doc = swarm_document("run", {"run-x": records}, now=100.0)
    alerts = doc["lineages"]["run-x"]["alerts"]
    assert alerts == ["peerDDDD left out of recent rounds by 2 learner(s): peerAAAA (9), peerBBBB (8)",
                      "peerCCCC left out of recent rounds by 1 learner(s): peerBBBB (1)",
                      "peerCCCC diverged and took the global state back 2 time(s)",
                      "peerDDDD saw its eval loss rise sharply after a round 1 time(s)"]
    assert doc["lineages"]["run-x"]["learners"][1]["excluded"] == [["peerDDDD", 8], ["peerCCCC", 1]]
    console = Console(record=True, width=200)
    console.print(render(doc))
    assert "alert: peerDDDD left out of recent rounds by 2 learner(s)" in console.export_text()


def test_a_swarm_where_nothing_went_wrong_has_no_alerts():
    doc = swarm_document("run", {"run-x": {"p1": _rec([2], [A]), "p2": _rec([2], [A])}}, now=100.0)
    assert doc["lineages"]["run-x"]["alerts"] == []
