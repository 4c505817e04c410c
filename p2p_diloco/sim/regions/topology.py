"""The topology of a simulated multi-region swarm, loaded from one TOML file.

The same file drives the namespace simulator (``p2p-diloco regions``) and the generated
``docker-compose.yml``, so both place every host at the same address::

    bootstrap_region = "eu"
    [[regions]]
    name = "eu"
    subnet = "10.77.1.0/24"
    learners = 2
    bandwidth = "50mbit"   # the region's WAN link, each direction
    delay_ms = 10          # one-way, added on each direction of the WAN link (needs netem)
    loss_pct = 0.0         # on traffic leaving the region (needs netem)
    nat = false            # true: behind NAT, its learners can dial out but cannot be dialled

Addresses inside a region's subnet: ``.2`` is the region's gateway to the backbone (``.1`` is left
to Docker's bridge), ``.10`` the bootstrap node if it lives there, and learners take addresses
from the upper half of the subnet (Docker's ``ip_range`` for containers added with ``--scale``).
Each region's gateway sits on the backbone network at ``backbone[10 + region index]``.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from p2p_diloco.config import config_error, read_toml

_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
_RATE_UNITS = {"bit": 1, "kbit": 1_000, "mbit": 1_000_000, "gbit": 1_000_000_000}

GATEWAY_HOST = 2
BOOTSTRAP_HOST = 10
BACKBONE_HOST_BASE = 10


def rate_bits_per_second(rate: str) -> int:
    """``"20mbit"`` -> 20_000_000 (tc's units: bits per second, decimal prefixes)."""
    m = _RATE.match(rate)
    if m is None:
        raise ValueError(f"bandwidth {rate!r} must look like 20mbit, 500kbit or 1gbit")
    return int(float(m.group(1)) * _RATE_UNITS[m.group(2)])


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Region(_Strict):
    """One region: a subnet of learners joined to the backbone by one shaped WAN link."""

    # Short: it becomes part of namespace, service and volume names.
    name: str = Field(pattern=r"^[a-z][a-z0-9]{0,7}$")
    subnet: ipaddress.IPv4Network
    learners: int = Field(ge=0, le=100)
    bandwidth: str = Field(description="WAN link rate in each direction, tc units (20mbit)")
    delay_ms: float = Field(0.0, ge=0.0, le=10_000.0, description="one-way delay per direction (netem)")
    loss_pct: float = Field(0.0, ge=0.0, lt=100.0, description="loss on traffic leaving the region (netem)")
    nat: bool = Field(False, description="behind NAT: the gateway masquerades outgoing connections and drops "
                                         "incoming ones, so the region's learners can dial out but not be dialled")

    @field_validator("bandwidth")
    @classmethod
    def _rate(cls, v: str) -> str:
        if rate_bits_per_second(v) < 8_000:
            raise ValueError(f"bandwidth {v} is below 8kbit")
        return v

    @field_validator("subnet")
    @classmethod
    def _big_enough(cls, v: ipaddress.IPv4Network) -> ipaddress.IPv4Network:
        if v.prefixlen > 24:
            raise ValueError(f"subnet {v} must be a /24 or larger")
        return v

    @property
    def gateway(self) -> ipaddress.IPv4Address:
        """The region's gateway: ``.2`` of its subnet."""
        return self.subnet[GATEWAY_HOST]

    @property
    def learner_range(self) -> ipaddress.IPv4Network:
        """The upper half of the subnet: learners' addresses (Docker's ``ip_range``)."""
        return list(self.subnet.subnets(prefixlen_diff=1))[1]

    def learner_addr(self, i: int) -> ipaddress.IPv4Address:
        """Address of the region's ``i``-th learner (from 0) in :attr:`learner_range`."""
        return self.learner_range[i + 1]

    @property
    def needs_netem(self) -> bool:
        """Whether the region's link has delay or loss, which only netem applies."""
        return self.delay_ms > 0 or self.loss_pct > 0


class Topology(_Strict):
    """Regions, the bootstrap node's place, and what every learner runs."""

    run_id: str = Field("regions", pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    learner_config: str = Field("peers/small-cpu.toml", description="peer config, relative to the project root")
    max_outer_steps: int = Field(10, ge=1)
    num_shards: int = Field(16, ge=1, le=100_000)
    backbone: ipaddress.IPv4Network = ipaddress.IPv4Network("10.77.0.0/24")
    bootstrap_region: str
    bootstrap_port: int = Field(31337, ge=1, le=65535)
    learner_port: int = Field(41000, ge=1, le=65535)
    regions: list[Region] = Field(min_length=1, max_length=200)

    @model_validator(mode="after")
    def _consistent(self) -> Topology:
        names = [r.name for r in self.regions]
        if len(set(names)) != len(names):
            raise ValueError(f"region names must be unique: {names}")
        if self.bootstrap_region not in names:
            raise ValueError(f"bootstrap_region {self.bootstrap_region!r} is not one of the regions {names}")
        nets = [self.backbone, *(r.subnet for r in self.regions)]
        for i, a in enumerate(nets):
            for b in nets[i + 1:]:
                if a.overlaps(b):
                    raise ValueError(f"subnets {a} and {b} overlap")
        if sum(r.learners for r in self.regions) < 1:
            raise ValueError("the topology has no learner")
        if self.region(self.bootstrap_region).nat:
            raise ValueError(f"bootstrap_region {self.bootstrap_region!r} has nat = true, but every learner must be "
                             "able to dial the bootstrap node: put it in a region without NAT")
        if all(r.nat for r in self.regions if r.learners > 0):
            raise ValueError("every learner is in a region with nat = true: learners behind NAT only send their "
                             "part, so at least one learner must be in a region without NAT to combine the parts")
        stride = self.shard_stride
        for r in self.regions:
            # Distinct shards for every learner: each region owns `stride` consecutive shards.
            if r.learners > stride:
                raise ValueError(f"region {r.name} has {r.learners} learners but only {stride} shards "
                                 f"(num_shards {self.num_shards} / {len(self.regions)} regions); raise num_shards")
            if r.learners > r.learner_range.num_addresses - 2:
                raise ValueError(f"region {r.name}: subnet {r.subnet} is too small for {r.learners} learners")
        return self

    @property
    def shard_stride(self) -> int:
        """Shards per region: ``num_shards // len(regions)``, at least 1."""
        return max(self.num_shards // len(self.regions), 1)

    def region(self, name: str) -> Region:
        """The region called ``name``; StopIteration if there is none."""
        return next(r for r in self.regions if r.name == name)

    def region_index(self, name: str) -> int:
        """Position of region ``name`` in :attr:`regions`; StopIteration if there is none."""
        return next(i for i, r in enumerate(self.regions) if r.name == name)

    def backbone_addr(self, region: str) -> ipaddress.IPv4Address:
        """The address of ``region``'s gateway on the backbone: ``backbone[10 + region index]``."""
        return self.backbone[BACKBONE_HOST_BASE + self.region_index(region)]

    @property
    def bootstrap_addr(self) -> ipaddress.IPv4Address:
        """The bootstrap node's address: ``.10`` of its region's subnet."""
        return self.region(self.bootstrap_region).subnet[BOOTSTRAP_HOST]

    def shard_base(self, region: str) -> int:
        """The first of ``region``'s :attr:`shard_stride` consecutive shards."""
        return (self.region_index(region) * self.shard_stride) % self.num_shards

    def shard_index(self, region: str, slot: int) -> int:
        """Shard of the ``slot``-th learner of ``region``: the region's block of shards, wrapping."""
        return (self.shard_base(region) + slot % self.shard_stride) % self.num_shards

    @property
    def netem_needed(self) -> bool:
        """Whether any region needs netem (delay or loss)."""
        return any(r.needs_netem for r in self.regions)


DEFAULT_TOPOLOGY = Path("regions") / "topology.toml"


def project_root() -> Path:
    """The directory above the ``p2p_diloco`` package: where :func:`resolve_path` looks second."""
    return Path(__file__).resolve().parents[3]


def resolve_path(path: str | Path) -> Path:
    """A relative path as given (from the current directory) if it exists, else from the project root."""
    p = Path(path)
    if p.is_absolute() or p.exists():
        return p
    alt = project_root() / p
    return alt if alt.exists() else p


def load_topology(path: str | Path = DEFAULT_TOPOLOGY) -> Topology:
    """Read and validate a topology file; problems become a one-line :class:`ConfigError`."""
    path = resolve_path(path)
    try:
        return Topology.model_validate(read_toml(path))
    except ValidationError as e:
        raise config_error(e, root="topology", source=path) from None
