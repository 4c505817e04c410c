"""Gathered metadata signed by its member (trust/signed_metadata.py): what a relaying leader may not change."""

import pytest
from hivemind.utils.serializer import MSGPackSerializer

from p2p_diloco.core.exclusion import Rules, judge
from p2p_diloco.trust.admission import peer_id_of
from p2p_diloco.trust.signed_metadata import FIELD, forged, sign
from p2p_diloco.trust.signed_records import IdentityKey


@pytest.fixture(scope="module")
def members(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    return [(peer_id_of(d / f"{i}.key"), IdentityKey.load(d / f"{i}.key")) for i in range(3)]


def _meta(weight=1.0, norm=1.0):
    return {"version": 4, "sha256": "a" * 64, "tokens": 2048, "steps": 20, "weight": weight, "norm": norm,
            "finite": True, "unit": False, "fragment": 0, "rules": (8.0, None, "mean", None, 40, "tokens"),
            "bans": ["x"]}


def test_signed_metadata_survives_hivemind_serialization_and_names_its_member(members):
    (peer, key), (other, _) = members[0], members[1]
    signed = MSGPackSerializer.loads(MSGPackSerializer.dumps(sign(_meta(), key)))  # as the group receives it
    assert forged(peer, signed) == ""
    assert forged(other, signed) == "its gathered metadata is signed with another peer's key"


@pytest.mark.parametrize(("change", "why"), [
    (lambda m: {**m, "weight": 1e15}, "changed after it signed it"),
    (lambda m: {**m, "bans": ["victim"]}, "changed after it signed it"),
    (lambda m: {**m, "norm": 0.5}, "changed after it signed it"),
    (lambda m: {k: v for k, v in m.items() if k != FIELD}, "not signed"),
    (lambda m: {**m, FIELD: [b"ssh-rsa garbage", m[FIELD][1]]}, "malformed signature"),
    (lambda m: {**m, FIELD: "x"}, "not signed"),
    (lambda m: [1, 2], "not a map"),
])
def test_a_changed_or_unsigned_entry_is_forged(members, change, why):
    peer, key = members[0]
    assert why in forged(peer, change(sign(_meta(), key)))


def test_the_verdict_excludes_a_forged_member_before_anything_it_said_counts(members):
    gathered = {p: sign(_meta(weight=float(i + 1)), k) for i, (p, k) in enumerate(members)}
    tampered = {**gathered, members[2][0]: {**gathered[members[2][0]], "weight": 1e15}}
    why = {members[2][0]: forged(members[2][0], tampered[members[2][0]])}
    verdict = judge(tampered, Rules(), why)
    assert verdict.excluded[members[2][0]].why == "its gathered metadata was changed after it signed it"
    assert set(verdict.weights) == {members[0][0], members[1][0]}
