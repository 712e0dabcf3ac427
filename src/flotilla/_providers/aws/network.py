"""The network side of an AWS pool: where its instances go and who may reach them.

The VPC (the given subnet's, or the region's default one) and a subnet per zone, the
client's address ranges, the pool's own security group (SSH from the client only, all
traffic between the pool's members, the ``ports`` asked, nothing else), with
``network_tier="best"`` its cluster placement group, and the tags every resource of the
pool carries (what the release and the orphan sweep find it by)."""

from __future__ import annotations

import os
import socket
import urllib.request
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from typing import Any

from ..._errors import ConfigurationError, ProvisionError
from ..cloud.identity import client_id
from .api import Api
from .settings import AWSSettings

TAG_POOL = "flotilla:pool"
TAG_OWNER = "flotilla:owner"
TAG_CLIENT = "flotilla:client"
TAG_CREATED = "flotilla:created"

Creating = Callable[[str, str], AbstractContextManager[None]]
"""``Allocation.creating``: held around every call that creates something."""


class PoolNetwork:
    """One pool's network (see the module docstring).

    Attributes:
        subnets: zone -> subnet id.
        vpc: the VPC's id.
        client_cidrs: the address ranges SSH is opened to (the client's).
        security_group: the pool's security group id ("" before it exists).
        placement_group: the pool's cluster placement group (network_tier="best"), or "".
        client: this client's identity (``cloud.identity``), in the tags.
        created: when the pool started (UTC), in the tags.
    """

    def __init__(self, api: Api, settings: AWSSettings, tag: str, creating: Creating) -> None:
        self.api = api
        self.settings = settings
        self.tag = tag
        self.creating = creating
        self.subnets: dict[str, str] = {}
        self.vpc = ""
        self.client_cidrs: list[str] = []
        self.security_group = ""
        self.placement_group = ""
        self.client = client_id()
        self.created = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    def find_subnets(self) -> tuple[dict[str, str], str, list[str]]:
        """(zone -> subnet, VPC id, the VPC's CIDRs): the given subnet, or one subnet per
        zone of the default VPC (its default subnets first)."""
        subnet = self.settings.subnet
        if subnet:
            found = self.api.call(
                "ec2", "describe_subnets", f"look up subnet {subnet}", SubnetIds=[subnet]
            )["Subnets"]
            vpc_id = found[0]["VpcId"]
            vpcs = self.api.call("ec2", "describe_vpcs", f"look up VPC {vpc_id}", VpcIds=[vpc_id])[
                "Vpcs"
            ]
        else:
            vpcs = self.api.call(
                "ec2",
                "describe_vpcs",
                "find the default VPC",
                Filters=[{"Name": "isDefault", "Values": ["true"]}],
            )["Vpcs"]
            if not vpcs:
                raise ConfigurationError(
                    f"region {self.api.region} has no default VPC: pass AWS(subnet=...)"
                )
            vpc_id = vpcs[0]["VpcId"]
            found = self.api.call(
                "ec2",
                "describe_subnets",
                "list the default VPC's subnets",
                Filters=[{"Name": "vpc-id", "Values": [vpc_id]}],
            )["Subnets"]
            found.sort(key=lambda s: (not s.get("DefaultForAz", False), s["SubnetId"]))
        subnets: dict[str, str] = {}
        for s in found:
            subnets.setdefault(s["AvailabilityZone"], s["SubnetId"])
        if not subnets:
            raise ConfigurationError(f"VPC {vpc_id} has no subnet: pass AWS(subnet=...)")
        vpc = vpcs[0]
        cidrs = [a["CidrBlock"] for a in vpc.get("CidrBlockAssociationSet", [])] or [
            vpc["CidrBlock"]
        ]
        return dict(sorted(subnets.items())), vpc_id, cidrs

    def tags(self, resource: str) -> dict[str, Any]:
        tags = {
            "Name": f"flotilla-{self.tag}",
            TAG_POOL: self.tag,
            TAG_OWNER: owner(),
            TAG_CLIENT: self.client,
            TAG_CREATED: self.created,
            **self.settings.tags,
        }
        return {"ResourceType": resource, "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}

    def make_placement_group(self) -> None:
        """A cluster placement group for the pool (network_tier="best"): its instances
        land close together, as EFA traffic wants."""
        name = f"flotilla-{self.tag}"
        with self.creating("placement group", self.tag):
            self.api.call(
                "ec2",
                "create_placement_group",
                "create the pool's placement group",
                GroupName=name,
                Strategy="cluster",
                TagSpecifications=[self.tags("placement-group")],
            )
            self.placement_group = name  # before the sweep can look

    def make_security_group(self) -> None:
        with self.creating("security group", self.tag):
            group = self.api.call(
                "ec2",
                "create_security_group",
                "create the pool's security group",
                GroupName=f"flotilla-{self.tag}",
                Description=f"flotilla pool {self.tag}: SSH from its client, members",
                VpcId=self.vpc,
                TagSpecifications=[self.tags("security-group")],
            )
            self.security_group = group["GroupId"]  # before the sweep can look
        self.api.call(
            "ec2",
            "authorize_security_group_ingress",
            "open the pool's security group to SSH and its members",
            GroupId=self.security_group,
            IpPermissions=[
                {
                    "IpProtocol": "tcp",
                    "FromPort": 22,
                    "ToPort": 22,
                    "IpRanges": [
                        {"CidrIp": c, "Description": "flotilla client"} for c in self.client_cidrs
                    ],
                },
                {"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": self.security_group}]},
                *(
                    {
                        "IpProtocol": "tcp",
                        "FromPort": low,
                        "ToPort": high,
                        "IpRanges": [{"CidrIp": "0.0.0.0/0", "Description": "AWS(ports=...)"}],
                    }
                    for low, high in self.settings.port_ranges()
                ),
            ],
        )


def public_cidr() -> str:
    """This machine's public address as a /32, from AWS's checkip service."""
    try:
        with urllib.request.urlopen("https://checkip.amazonaws.com", timeout=5) as resp:
            addr = resp.read().decode().strip()
        socket.inet_aton(addr)
    except (OSError, ValueError) as e:
        raise ProvisionError(
            f"cannot learn this machine's public address (to open SSH to it only): {e}; from "
            "inside the VPC use AWS(private_ips=True)"
        ) from e
    return f"{addr}/32"


def owner() -> str:
    try:
        user = os.getlogin()
    except OSError:
        user = os.environ.get("USER", "") or str(os.getuid())
    return f"{user}@{socket.gethostname()}"
