"""Commit certificates: signatures, the verifier's rule, hostile input, and collecting over a DHT."""

import threading
import time
from types import SimpleNamespace

import msgpack
import pytest

from p2p_diloco.core.outer import CERTIFIED_VERSIONS, GlobalState, StateFormatError
from p2p_diloco.trust.admission import peer_id_of
from p2p_diloco.trust.certificates import Certificate, Commit, Signature, Verifier, find
from p2p_diloco.trust.commit_board import CommitBoard
from p2p_diloco.trust.signed_records import IdentityKey

SHA, PARENT = "a" * 64, "b" * 64


@pytest.fixture(scope="module")
def peers(tmp_path_factory):
    """(peer id, key) of four learners."""
    d = tmp_path_factory.mktemp("keys")
    return [(peer_id_of(d / f"{i}.key"), IdentityKey.load(d / f"{i}.key")) for i in range(4)]


def _commit(peers, n=3, version=5, sha=SHA):
    return Commit("run-lin", 0, version, sha, PARENT, tuple(sorted(p for p, _ in peers[:n])))


def _cert(peers, commit, signers):
    return Certificate(commit, tuple(Signature.make(peers[i][1], commit) for i in signers))


def test_signatures_name_their_signer_and_bind_the_commit(peers):
    commit = _commit(peers)
    sig = Signature.make(peers[0][1], commit)
    assert sig.signer(commit) == peers[0][0]
    assert sig.signer(Commit(**{**commit.to_dict(), "contributors": tuple(commit.contributors), "version": 6})) is None
    assert Signature(sig.public_key, b"AAAA" + sig.signature[4:]).signer(commit) is None
    assert Signature(b"ssh-rsa garbage", sig.signature).signer(commit) is None


def test_the_verifier_wants_a_quorum_of_distinct_contributors(peers):
    commit = _commit(peers)
    versions = [_cert(peers, commit, [0, 1]).to_dict()]
    v = Verifier("run-lin", quorum=2)
    assert v.check(0, 5, SHA, versions) == ""
    assert v.contributors(5, versions) == commit.contributors
    assert "fewer than the quorum 3" in Verifier("run-lin", quorum=3).check(0, 5, SHA, versions)
    twice = [_cert(peers, commit, [0, 0]).to_dict()]  # one signer twice
    assert "1 valid signer" in v.check(0, 5, SHA, twice)
    outsider = [_cert(peers, commit, [0, 3]).to_dict()]  # peer 3 is not a contributor
    assert "1 valid signer" in v.check(0, 5, SHA, outsider)
    private = Verifier("run-lin", quorum=2, admitted=frozenset({peers[0][0]}))
    assert "1 valid signer" in private.check(0, 5, SHA, versions)
    assert "another state" in v.check(0, 5, "c" * 64, versions)
    assert "another state" in Verifier("other-lin", 2).check(0, 5, SHA, versions)
    assert "without a commit certificate" in v.check(0, 6, SHA, versions)
    assert v.contributors(6, versions) is None


def test_two_colluders_cannot_certify_a_state_of_their_choosing_in_a_larger_swarm(peers):
    """Two members that name only themselves as contributors and both sign: enough for K = 2 alone, not for
    half of the round quorum of a swarm of 8 or 9 learners training (5: 3 signers)."""
    chosen = _commit(peers, n=2, sha="c" * 64)
    colluded = [_cert(peers, chosen, [0, 1]).to_dict()]
    assert Verifier("run-lin", 2).check(0, 5, "c" * 64, colluded) == ""  # the hole: K = 2 signatures
    nine = Verifier("run-lin", 2, round_quorum=lambda: 5)
    assert "fewer than the quorum 3" in nine.check(0, 5, "c" * 64, colluded)
    assert nine.contributors(5, colluded) is None
    honest = _commit(peers, n=3)
    assert nine.check(0, 5, SHA, [_cert(peers, honest, [0, 1, 2]).to_dict()]) == ""
    assert Verifier("run-lin", 2, round_quorum=lambda: 3).check(0, 5, "c" * 64, colluded) == ""  # 4 or 5 learners

    # The colluders' own board waits for as many signers as verifiers will ask for: it cannot certify either.
    board = CommitBoard(_Dht({}, b"me"), "run-lin", peers[0][1], quorum=2, timeout=0.2, poll=0.01,
                        round_quorum=lambda: 5)
    assert "1 of the quorum 3 signatures" in board.certify(chosen)


def test_a_merge_may_be_signed_by_any_admitted_peer(peers):
    merge = Commit("run-lin", 0, 9, SHA, "", ())
    assert Verifier("run-lin", 2).check(0, 9, SHA, [_cert(peers, merge, [2, 3]).to_dict()]) == ""
    assert Verifier("run-lin", 2).contributors(9, [_cert(peers, merge, [2, 3]).to_dict()]) is None


@pytest.mark.parametrize("entry", [
    {"commit": {"version": 5}},
    {"commit": {**Commit("run-lin", 0, 5, SHA, PARENT).to_dict(), "fragment": -1}, "signatures": []},
    {"commit": {**Commit("run-lin", 0, 5, SHA, PARENT).to_dict(), "sha256": "xyz"}, "signatures": []},
    {"commit": {**Commit("run-lin", 0, 5, SHA, PARENT).to_dict(), "contributors": [1]}, "signatures": []},
    {"commit": Commit("run-lin", 0, 5, SHA, PARENT).to_dict(), "signatures": [["only one"]]},
    {"commit": Commit("run-lin", 0, 5, SHA, PARENT).to_dict(), "signatures": [[b"k", b"s"]] * 1000},
])
def test_malformed_certificates_are_reported_not_raised(entry):
    found = find([entry], 5)
    assert isinstance(found, str)
    assert "malformed certificate" in Verifier("run-lin", 1).check(0, 5, SHA, [entry])


def test_a_state_carries_the_newest_certificates_through_its_format(peers):
    state = GlobalState(params=[], momentum=[])
    for v in range(1, CERTIFIED_VERSIONS + 4):
        state.add_certificate(v, _cert(peers, _commit(peers, version=v), [0]).to_dict())
    kept = [c["commit"]["version"] for c in state.certificates]
    assert kept == list(range(4, CERTIFIED_VERSIONS + 4))
    again = GlobalState.from_dict(state.to_dict())
    assert again.certificates == state.certificates and state.copy().certificates == state.certificates
    with pytest.raises(StateFormatError, match="certificates"):
        GlobalState.from_dict({**state.to_dict(), "certificates": ["x"]})
    with pytest.raises(StateFormatError, match="certificates"):
        GlobalState.from_dict({**state.to_dict(), "certificates": [{}] * 100})


class _Dht:
    """A DHT stand-in holding one dictionary per key (subkey → value), shared by the boards of a test."""

    def __init__(self, shared, owner):
        self.shared, self.owner = shared, owner

    def store(self, key, value, expiration, subkey):
        self.shared.setdefault(key, {})[subkey] = SimpleNamespace(value=value)
        return True

    def get(self, key, latest=True):
        found = self.shared.get(key)
        return None if found is None else SimpleNamespace(value=dict(found))


def test_members_collect_each_others_signatures(peers):
    shared: dict = {}
    commit = _commit(peers)
    boards = [CommitBoard(_Dht(shared, f"owner-{i}".encode()), "run-lin", peers[i][1], quorum=2, timeout=5,
                          poll=0.01) for i in range(3)]
    # A forger's entry under the same key: another commit, and garbage.
    shared.setdefault("run-lin_commit_0_5", {})[b"x"] = SimpleNamespace(value=msgpack.packb(
        {"commit": _commit(peers, sha="c" * 64).to_dict(),
         "signature": Signature.make(peers[3][1], _commit(peers, sha="c" * 64)).to_list()}))
    shared["run-lin_commit_0_5"][b"y"] = SimpleNamespace(value=b"\xc1garbage")
    results = [None] * 3

    def go(i):
        results[i] = boards[i].certify(commit)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(3)]
    [t.start() for t in threads]
    [t.join(10) for t in threads]
    for r in results:  # each waits for every contributor (settling for 1 s once it has the quorum)
        assert isinstance(r, Certificate) and r.signers() == set(commit.contributors), r
        assert Verifier("run-lin", 3).check(0, 5, SHA, [r.to_dict()]) == ""


def test_a_commit_without_a_quorum_fails_at_the_deadline(peers):
    board = CommitBoard(_Dht({}, b"me"), "run-lin", peers[0][1], quorum=2, timeout=0.2, poll=0.01)
    out = board.certify(_commit(peers))
    assert isinstance(out, str) and "1 of the quorum 2 signatures" in out
    alone = CommitBoard(_Dht({}, b"me"), "run-lin", peers[0][1], quorum=1)
    cert = alone.certify(Commit("run-lin", 0, 5, SHA, PARENT, (peers[0][0],)))
    assert isinstance(cert, Certificate) and cert.signers() == {peers[0][0]}


def test_a_merge_waits_for_a_quorum_of_signers_though_it_names_no_contributors(peers):
    merge = Commit("run-lin", 0, 9, SHA, "", ())
    alone = CommitBoard(_Dht({}, b"me"), "run-lin", peers[0][1], quorum=2, timeout=0.2, poll=0.01)
    out = alone.certify(merge)
    assert isinstance(out, str) and "1 of the quorum 2 signatures" in out  # our own signature is not a quorum
    shared: dict = {}
    boards = [CommitBoard(_Dht(shared, f"owner-{i}".encode()), "run-lin", peers[i][1], quorum=2, timeout=5,
                          poll=0.01) for i in range(2)]
    results = [None, None]

    def go(i):
        results[i] = boards[i].certify(merge)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join(10) for t in threads]
    for r in results:
        assert isinstance(r, Certificate) and len(r.signers()) == 2, r
        assert Verifier("run-lin", 2).check(0, 9, SHA, [r.to_dict()]) == ""


def test_a_member_signs_only_once_every_contributors_sketch_passes_its_check(peers):
    """Sketches first (p2p_diloco/core/shard_sketches.py): a failed check means no signature of ours is ever stored."""
    shared: dict = {}
    commit = _commit(peers)
    owners = {f"owner-{i}".encode(): peers[i][0] for i in range(3)}
    seen: list = [None] * 3

    def board(i, timeout=5.0):
        return CommitBoard(_Dht(shared, f"owner-{i}".encode()), "run-lin", peers[i][1], quorum=2, timeout=timeout,
                           poll=0.01, owner_of=owners.get)

    def publish(i):  # what each member's averager stores right after the all-reduce
        shared.setdefault("sk", {})[f"owner-{i}".encode()] = SimpleNamespace(value=msgpack.packb({"from": i}))

    def verify(i, verdict):
        def check(sketches):
            seen[i] = dict(sketches)
            return verdict
        return check

    results: list = [None] * 3

    def go(i, verdict):
        results[i] = board(i).certify(commit, sketch={"from": i}, verify=verify(i, verdict), sketch_key="sk")

    for i in range(3):
        publish(i)
    shared["sk"][b"unsigned"] = SimpleNamespace(value=msgpack.packb({"from": "a forger"}))  # names no owner
    threads = [threading.Thread(target=go, args=(i, "")) for i in range(3)]
    [t.start() for t in threads]
    [t.join(10) for t in threads]
    for i, r in enumerate(results):
        assert isinstance(r, Certificate) and r.signers() == set(commit.contributors), r
        assert seen[i] == {peers[j][0]: {"from": j} for j in range(3)}  # every contributor's sketch, no forger's

    # A check that fails: the round fails with its reason, and no signature of ours reaches the DHT.
    del shared["run-lin_commit_0_5"]
    others = [threading.Thread(target=go, args=(i, "")) for i in (1, 2)]
    [t.start() for t in others]
    refused = board(0).certify(commit, sketch={"from": 0}, verify=verify(0, "the shard reduced by x lied"),
                               sketch_key="sk")
    [t.join(10) for t in others]
    assert refused == "the shard reduced by x lied"
    assert b"owner-0" not in shared["run-lin_commit_0_5"]
    assert all(isinstance(r, Certificate) and r.signers() == {peers[1][0], peers[2][0]} for r in results[1:])

    # A contributor whose sketch never comes: the others cannot check, and sign nothing.
    shared.clear()
    publish(1)
    out = board(0, timeout=0.3).certify(commit, sketch={"from": 0}, verify=verify(0, ""), sketch_key="sk")
    assert isinstance(out, str) and "could not be checked, no sketch from" in out and peers[2][0][-6:] in out, out
    assert out.blamed == (peers[2][0],)  # the failure has an owner: the learner bans it (learner/round.py)
    assert "run-lin_commit_0_5" not in shared


def test_a_contributor_that_signs_another_hash_of_the_new_state_is_named(peers):
    """After an all-reduce every member holds the same sum: a contributor that signs the round's commit with
    another hash (same round: parent, contributors) is named; one that signs another round's is not."""
    shared: dict = {}
    commit = _commit(peers, n=2)
    other = Commit(**{**commit.to_dict(), "contributors": commit.contributors, "sha256": "c" * 64})
    shared["run-lin_commit_0_5"] = {b"owner-1": SimpleNamespace(value=msgpack.packb(
        {"commit": other.to_dict(), "signature": Signature.make(peers[1][1], other).to_list()}))}
    board = CommitBoard(_Dht(shared, b"owner-0"), "run-lin", peers[0][1], quorum=2, timeout=0.2, poll=0.01)
    out = board.certify(commit)
    assert isinstance(out, str) and "signed another hash" in out and out.blamed == (peers[1][0],), out
    elsewhere = Commit(**{**other.to_dict(), "contributors": commit.contributors, "parent": "d" * 64})
    shared["run-lin_commit_0_5"] = {b"owner-1": SimpleNamespace(value=msgpack.packb(
        {"commit": elsewhere.to_dict(), "signature": Signature.make(peers[1][1], elsewhere).to_list()}))}
    assert board.certify(commit).blamed == ()  # another parent: another round, no evidence against it


def test_certificates_link_a_state_to_an_ancestor_by_parent_hashes_or_say_they_cannot(peers):
    """A chain 3 -> 4 -> 5 -> 6 of certified commits: the state at 6 links down to 3's sha, not to another
    sha at 3; a weak or missing certificate on the way, or a merge, leaves it unknown."""
    members = tuple(sorted(p for p, _ in peers[:3]))
    shas = {v: f"{v:x}" * 64 for v in range(3, 7)}

    def chain(weak=None, merge_at=None):
        out = []
        for v in range(4, 7):
            commit = Commit("run-lin", 0, v, shas[v], "" if v == merge_at else shas[v - 1],
                            () if v == merge_at else members)
            out.append(_cert(peers, commit, [0] if v == weak else [0, 1]).to_dict())
        return out

    v = Verifier("run-lin", quorum=2)
    assert v.linked(0, (6, shas[6]), (3, shas[3]), chain()) is True
    assert v.linked(0, (6, shas[6]), (5, shas[5]), chain()) is True
    assert v.linked(0, (6, shas[6]), (6, shas[6]), chain()) is True
    assert v.linked(0, (6, shas[6]), (3, "f" * 64), chain()) is False  # a history that lists another state at 3
    assert v.linked(0, (6, shas[6]), (4, "f" * 64), chain()) is False
    assert v.linked(0, (6, shas[6]), (3, shas[3]), chain(weak=5)) is None  # one signer at 5: cannot tell
    assert v.linked(0, (6, shas[6]), (3, shas[3]), chain()[1:]) is None  # 4's certificate no longer carried
    assert v.linked(0, (6, shas[6]), (3, shas[3]), chain(merge_at=5)) is None  # a merge names no parent
    assert v.linked(0, (6, "f" * 64), (3, shas[3]), chain()) is None  # not even the top is certified
    assert v.linked(0, (6, shas[6]), (7, shas[6]), chain()) is None  # "ancestor" above the state


def test_the_wait_for_signatures_lasts_at_least_the_rounds_all_reduce(peers):
    """A constant wait is right for one link: at 1 Mbit/s one member gave up after 10 s while the others, whose
    records came through behind the all-reduce's data, committed (WAN benchmark, 2026-12-05)."""
    board = CommitBoard(_Dht({}, b"me"), "run-lin", peers[0][1], quorum=2, timeout=0.1, poll=0.01)
    started = time.monotonic()
    out = board.certify(_commit(peers), patience=0.4)
    assert isinstance(out, str) and "within 0.4 s" in out and time.monotonic() - started >= 0.4
    for patience in (0.0, 0.05, float("nan"), float("inf")):  # shorter than the timeout, or not a duration
        out = board.certify(_commit(peers), patience=patience)
        assert isinstance(out, str) and "within 0.1 s" in out, patience


@pytest.fixture(scope="module")
def swarm_of_seven(tmp_path_factory):
    """(peer id, key) of 3 honest learners and 4 fresh identities of one attacker."""
    d = tmp_path_factory.mktemp("seven")
    return [(peer_id_of(d / f"{i}.key"), IdentityKey.load(d / f"{i}.key")) for i in range(7)]


def test_four_fresh_identities_cannot_certify_a_state_of_their_choosing(swarm_of_seven):
    """3 established learners and 4 keys that one attacker made a moment ago: the keys name only themselves as
    contributors of a chosen state and all sign. Counted as identities (7 records training: a majority of 4, so
    2 signers) they certify it; counted by standing they are nobody, and the swarm's quorum is that of the 3."""
    from p2p_diloco.core import standing as standings

    honest, sybils = swarm_of_seven[:3], swarm_of_seven[3:]
    standing = {p: 6 for p, _ in honest}  # six certified rounds each; the attacker's keys none

    def established(fragment):
        return standings.established(standing, after=4, floor=2)

    chosen = Commit("run-lin", 0, 5, "c" * 64, PARENT, tuple(sorted(p for p, _ in sybils)))
    colluded = [Certificate(chosen, tuple(Signature.make(k, chosen) for _, k in sybils)).to_dict()]
    assert Verifier("run-lin", 2, round_quorum=lambda: 4).check(0, 5, "c" * 64, colluded) == ""  # the hole
    guarded = Verifier("run-lin", 2, round_quorum=lambda: 2, established=established)
    assert "0 established signer(s), fewer than the quorum 2" in guarded.check(0, 5, "c" * 64, colluded)
    assert guarded.contributors(5, colluded) is None

    # An honest round with one of the keys among its contributors is certified by its established members.
    mixed = Commit("run-lin", 0, 5, SHA, PARENT, tuple(sorted([*(p for p, _ in honest), sybils[0][0]])))
    signed = [Certificate(mixed, tuple(Signature.make(k, mixed) for _, k in [*honest[:2], sybils[0]])).to_dict()]
    assert guarded.check(0, 5, SHA, signed) == ""
    assert guarded.contributors(5, signed) == mixed.contributors

    # The attacker's own board does not reach a quorum either: its keys' signatures do not count.
    shared: dict = {}
    for i, (_, k) in enumerate(sybils[1:]):
        shared.setdefault("run-lin_commit_0_5", {})[f"s{i}".encode()] = SimpleNamespace(value=msgpack.packb(
            {"commit": chosen.to_dict(), "signature": Signature.make(k, chosen).to_list()}))
    board = CommitBoard(_Dht(shared, b"me"), "run-lin", sybils[0][1], quorum=2, timeout=0.3, poll=0.01,
                        established=established)
    assert "0 of the quorum 2 established signatures" in board.certify(chosen)


def test_a_merge_needs_one_established_signer(swarm_of_seven):
    """After a partition each side credited only its own members: a merge certificate counts any admitted signer
    once one of them is established (the other side's newcomers may sign it: the Compose test's fork), but K fresh
    keys that call a state of their choosing a merge certify nothing."""
    from p2p_diloco.core import standing as standings

    merge = Commit("run-lin", 0, 9, SHA, "", ())
    ours = {p: 6 for p, _ in swarm_of_seven[:3]}
    verifier = Verifier("run-lin", 2, established=lambda f: standings.established(ours, after=4, floor=2))

    def cert(signers):
        return [Certificate(merge, tuple(Signature.make(k, merge) for _, k in signers)).to_dict()]

    fresh = swarm_of_seven[3:7]
    assert Verifier("run-lin", 2).check(0, 9, SHA, cert(fresh)) == ""  # counted as identities: the hole
    assert "0 established signer(s)" in verifier.check(0, 9, SHA, cert(fresh))
    assert verifier.check(0, 9, SHA, cert([swarm_of_seven[0], *fresh[:1]])) == ""  # one established, one newcomer
