"""An EC2 region on this machine: moto's real HTTP EC2/SSM API, and instances that boot.

``AwsLab`` (root only) starts moto in server mode on a test bridge's address and points
boto3 at it (``AWS_ENDPOINT_URL``, dummy credentials: ``env``, in ``os.environ`` only
inside a with-block on the lab or a test's ``aws_lab`` fixture): the provider runs unchanged. The
default VPC gets the bridge's /24 (two subnets, two zones) instead of its own subnets,
so instances get private addresses on the bridge, in order. A watcher thread follows the
API: every instance launched is at once a network-namespace host with the instance's
private address and an instance metadata stand-in on 169.254.169.254 (IMDSv2 token,
``spot/instance-action``), as its network interface is on EC2; it "boots" ``boot_delay``
seconds after the launch: its sshd, configured from the instance's user-data as cloud-init
would (host key from ``ssh_keys``, ``ssh_authorized_keys``), starts. Before that, as soon as
the network is there, the user-data's ``bootcmd`` runs in the host as cloud-init's init
stage runs it (one ``/bin/sh`` script, as root, ``INSTANCE_ID`` set, output to the
instance's console log, :meth:`AwsLab.console`); what it leaves running stays in the host.
Terminating the instance stops the host and everything in it. Stopping it (StopInstances)
kills everything running in the host (sshd, agents, watchdogs, what bootcmd left) but keeps
the host's folder, its "disk" (its host key; the rest of the file system is shared with
this machine anyway); starting it again (StartInstances) boots it as EC2 boots a stopped
instance: the metadata service, the user-data's ``bootcmd`` again (cloud-init runs it at
every boot), then sshd with the same host key, ``boot_delay`` seconds after the start.
:attr:`AwsLab.power` counts the stops and starts seen per instance.

Faults come from the emulator's side: :meth:`AwsLab.fail_launches` makes RunInstances
answer with an error code (capacity, quota) for a market and zone, as AWS would; the
provider has no test branch. :meth:`AwsLab.interrupt` announces a spot interruption in an
instance's metadata. The pytest fixture ``aws_lab`` wraps it: one lab per process, shared by
every test module that imports the fixtures (moto's state is the process's), its
environment applied for one test at a time.
"""

from __future__ import annotations

import base64
import contextlib
import io
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import pytest
import yaml
from _hosts import (
    SERVE_POLL,
    Lab,
    LabError,
    SharedLab,
    TestHost,
    _in_netns,
    keygen,
    lab_unavailable,
)
from _lifecycle import Lifecycle, environment

REGION = "us-east-1"
ZONES = ("us-east-1a", "us-east-1b")
UBUNTU_PARAM = "/aws/service/canonical/ubuntu/server/24.04/stable/current/amd64/hvm/ebs-gp3/ami-id"
GPU_PARAM = (
    "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-24.04/latest/ami-id"
)
ACCOUNT = "123456789012"  # moto's default account

_IMDS = r"""
import http.server, os, secrets, sys
folder, instance = sys.argv[1], sys.argv[2]
token = secrets.token_hex(16)

class Handler(http.server.BaseHTTPRequestHandler):
    def _send(self, code, body=b""):
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_PUT(self):
        ok = self.path == "/latest/api/token"
        ok = ok and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
        self._send(200, token.encode()) if ok else self._send(400)

    def do_GET(self):
        if self.headers.get("X-aws-ec2-metadata-token") != token:
            return self._send(401)
        if self.path == "/latest/meta-data/instance-id":
            return self._send(200, instance.encode())
        if self.path == "/latest/meta-data/spot/instance-action":
            try:
                with open(os.path.join(folder, "instance-action"), "rb") as f:
                    return self._send(200, f.read())
            except OSError:
                return self._send(404)
        self._send(404)

    def log_message(self, *args):
        pass

server = http.server.ThreadingHTTPServer(("169.254.169.254", 80), Handler)
print("ready", flush=True)
server.serve_forever()
"""


@dataclass
class Rule:
    """RunInstances answers ``code`` for launches in ``market`` ("spot"/"on-demand"/None:
    any) and ``zone`` (None: any), ``times`` times (None: always); with ``action``
    "StartInstances", every StartInstances does (market and zone not looked at)."""

    code: str
    market: str | None = None
    zone: str | None = None
    times: int | None = None
    action: str = "RunInstances"


_STATE_CHANGES = frozenset(
    {"RunInstances", "TerminateInstances", "StopInstances", "StartInstances", "RebootInstances"}
)
_LIVE = ["pending", "running", "shutting-down", "stopping", "stopped"]


class PlacementGroups:
    """EC2's placement groups, which moto lacks: CreatePlacementGroup,
    DescribePlacementGroups (by name or by ``tag-key``/``tag:K`` filter) and
    DeletePlacementGroup, with AWS's error codes (``InvalidPlacementGroup.Duplicate``,
    ``.Unknown``, ``.InUse`` while an instance launched into it is not terminated), and
    RunInstances into an unknown group refused as AWS refuses it. Responses follow the EC2
    query API's XML (``placementGroup`` / ``placementGroupSet`` items: groupName, groupId,
    strategy, state, tagSet)."""

    ACTIONS = frozenset({"CreatePlacementGroup", "DescribePlacementGroups", "DeletePlacementGroup"})

    def __init__(self) -> None:
        self.groups: dict[str, dict[str, Any]] = {}  # name -> strategy, id, tags
        self.members: dict[str, set[str]] = {}  # name -> instance ids not terminated
        self.lock = threading.Lock()

    def answer(self, action: str, params: dict[str, str]) -> tuple[int, bytes]:
        with self.lock:
            if action == "CreatePlacementGroup":
                name = params.get("GroupName", "")
                if name in self.groups:
                    return _ec2_error("InvalidPlacementGroup.Duplicate", f"{name} exists")
                tags = _tags_of(params)
                self.groups[name] = {
                    "strategy": params.get("Strategy", "cluster"),
                    "id": f"pg-{len(self.groups) + 1:017x}",
                    "tags": tags,
                }
                self.members[name] = set()
                return 200, _ec2_xml(action, f"<placementGroup>{self._item(name)}</placementGroup>")
            if action == "DescribePlacementGroups":
                wanted = [v for k, v in params.items() if k.startswith("GroupName.")]
                names = [n for n in self.groups if not wanted or n in wanted]
                names = [n for n in names if _matches(self.groups[n]["tags"], params)]
                items = "".join(f"<item>{self._item(n)}</item>" for n in names)
                return 200, _ec2_xml(action, f"<placementGroupSet>{items}</placementGroupSet>")
            name = params.get("GroupName", "")  # DeletePlacementGroup
            if name not in self.groups:
                return _ec2_error("InvalidPlacementGroup.Unknown", f"{name} is unknown")
            if self.members[name]:
                return _ec2_error("InvalidPlacementGroup.InUse", f"{name} is in use")
            del self.groups[name], self.members[name]
            return 200, _ec2_xml(action, "<return>true</return>")

    def unknown(self, params: dict[str, str]) -> str:
        """The RunInstances placement group that does not exist ('' when fine)."""
        name = params.get("Placement.GroupName", "")
        with self.lock:
            return name if name and name not in self.groups else ""

    def launched(self, params: dict[str, str], reply: bytes) -> None:
        name = params.get("Placement.GroupName", "")
        if name:
            ids = re.findall(rb"<instanceId>(i-[0-9a-f]+)</instanceId>", reply)
            with self.lock:
                self.members.setdefault(name, set()).update(i.decode() for i in ids)

    def terminated(self, params: dict[str, str]) -> None:
        ids = {v for k, v in params.items() if k.startswith("InstanceId.")}
        with self.lock:
            for members in self.members.values():
                members -= ids

    def _item(self, name: str) -> str:
        g = self.groups[name]
        tags = "".join(
            f"<item><key>{k}</key><value>{v}</value></item>" for k, v in g["tags"].items()
        )
        return (
            f"<groupName>{name}</groupName><groupId>{g['id']}</groupId>"
            f"<strategy>{g['strategy']}</strategy><state>available</state>"
            f"<tagSet>{tags}</tagSet>"
        )


def _tags_of(params: dict[str, str]) -> dict[str, str]:
    keys = {k[: -len(".Key")]: v for k, v in params.items() if k.endswith(".Key")}
    return {v: params.get(f"{prefix}.Value", "") for prefix, v in keys.items()}


def _matches(tags: dict[str, str], params: dict[str, str]) -> bool:
    """Whether ``tags`` pass the request's ``tag-key`` / ``tag:K`` filters."""
    for key, name in params.items():
        if not (key.startswith("Filter.") and key.endswith(".Name")):
            continue
        prefix = key[: -len(".Name")]
        values = [v for k, v in params.items() if k.startswith(f"{prefix}.Value.")]
        if name == "tag-key" and not any(v in tags for v in values):
            return False
        if name.startswith("tag:") and tags.get(name[4:]) not in values:
            return False
    return True


def _ec2_xml(action: str, body: str) -> bytes:
    ns = "http://ec2.amazonaws.com/doc/2016-11-15/"
    return (
        f'<?xml version="1.0" encoding="UTF-8"?><{action}Response xmlns="{ns}">'
        f"<requestId>lab</requestId>{body}</{action}Response>"
    ).encode()


def _ec2_error(code: str, message: str) -> tuple[int, bytes]:
    xml = (
        '<?xml version="1.0" encoding="UTF-8"?><Response><Errors><Error>'
        f"<Code>{code}</Code><Message>{message}</Message></Error></Errors>"
        "<RequestID>lab</RequestID></Response>"
    ).encode()
    return 400, xml


class Faults:
    """WSGI middleware in front of moto: counts requests by action, answers RunInstances
    with the errors the rules say (an AWS-shaped error response), and serves placement
    groups (:class:`PlacementGroups`), which moto lacks."""

    def __init__(self, app: Callable[..., Any], zone_of: dict[str, str]) -> None:
        self.app = app
        self.zone_of = zone_of
        self.rules: list[Rule] = []
        self.calls: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.on_change: Callable[[], None] = lambda: None
        """Called after a request that changes instances' states was answered."""
        self.placement = PlacementGroups()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        length = int(environ.get("CONTENT_LENGTH") or 0)
        body = environ["wsgi.input"].read(length) if length else b""
        environ["wsgi.input"] = io.BytesIO(body)
        params = {k: v[0] for k, v in parse_qs(body.decode(errors="replace")).items()}
        action = params.get("Action", "")
        if environ.get("HTTP_X_AMZ_TARGET", "").startswith("AWSPriceListService."):
            # moto has no Price List API: answer as AWS does a user without permission
            # (instead of moto's 500 and its message on stdout)
            denied = (
                b'{"__type": "AccessDeniedException", "message": "the emulator has no '
                b'Price List API"}'
            )
            start_response(
                "400 Bad Request",
                [
                    ("Content-Type", "application/x-amz-json-1.1"),
                    ("Content-Length", str(len(denied))),
                ],
            )
            return [denied]
        if action in PlacementGroups.ACTIONS or (
            action == "RunInstances" and self.placement.unknown(params)
        ):
            if action == "RunInstances":
                group = self.placement.unknown(params)
                code, xml = _ec2_error("InvalidPlacementGroup.Unknown", f"{group} is unknown")
            else:
                code, xml = self.placement.answer(action, params)
            status = "200 OK" if code == 200 else "400 Bad Request"
            start_response(
                status, [("Content-Type", "text/xml"), ("Content-Length", str(len(xml)))]
            )
            return [xml]
        if action == "TerminateInstances":
            self.placement.terminated(params)
        if action == "StartInstances":
            with self.lock:
                for rule in self.rules:
                    if rule.action == action and rule.times != 0:
                        if rule.times is not None:
                            rule.times -= 1
                        code, xml = _ec2_error(rule.code, "test: no capacity to start")
                        start_response(
                            "400 Bad Request",
                            [("Content-Type", "text/xml"), ("Content-Length", str(len(xml)))],
                        )
                        return [xml]
        if action == "RunInstances":
            market = (
                "spot"
                if params.get("InstanceMarketOptions.MarketType") == "spot"
                else ("on-demand")
            )
            subnet = params.get("NetworkInterface.1.SubnetId") or params.get("SubnetId", "")
            zone = self.zone_of.get(subnet, "")
            with self.lock:
                for rule in self.rules:
                    if rule.times == 0 or rule.action != action:
                        continue
                    if rule.market in (None, market) and rule.zone in (None, zone):
                        if rule.times is not None:
                            rule.times -= 1
                        xml = (
                            '<?xml version="1.0" encoding="UTF-8"?><Response><Errors><Error>'
                            f"<Code>{rule.code}</Code><Message>test: no {market} capacity in "
                            f"{zone}</Message></Error></Errors><RequestID>x</RequestID></Response>"
                        ).encode()
                        start_response(
                            "400 Bad Request",
                            [("Content-Type", "text/xml"), ("Content-Length", str(len(xml)))],
                        )
                        return [xml]
        result = self.app(environ, start_response)
        if action == "RunInstances" and params.get("Placement.GroupName"):
            body = b"".join(result)
            self.placement.launched(params, body)
            result = [body]
        if action in _STATE_CHANGES:
            self.on_change()
        return result


@dataclass
class Instance:
    """A booted (or booting) instance of the lab."""

    instance_id: str
    addr: str
    host: TestHost | None = None
    imds: subprocess.Popen[bytes] | None = None
    seen: float = 0.0
    bootcmd_at: float = 0.0  # wall clock when cloud-init's bootcmd started (0: none)
    console: Path | None = None  # the console log (cloud-init's output)
    lock: threading.Lock = field(default_factory=threading.Lock)  # boot vs. shutdown
    stopped: threading.Event = field(default_factory=threading.Event)  # terminated
    user_data: dict[str, Any] = field(default_factory=dict)  # the #cloud-config
    boot: int = 0  # boots so far (a stop makes a pending boot's sshd start moot)
    off: bool = False  # stopped (StopInstances): nothing runs in the host


class AwsLab(Lifecycle):
    """moto + booting instances (see the module docstring). A context manager."""

    running: AwsLab | None = None
    """The lab started in this process and not closed yet (one at a time)."""

    def __init__(self, boot_delay: float = 0.0) -> None:
        self.boot_delay = boot_delay
        self.lab = Lab()
        self.server: Any = None
        self.faults: Faults | None = None
        self.endpoint = ""
        self.subnets: dict[str, str] = {}  # zone -> subnet id
        self.ami = ""
        self.instances: dict[str, Instance] = {}
        self.booted: list[str] = []
        self.power: Counter[tuple[str, str]] = Counter()  # (instance, "stop"/"start") seen
        self.boot_times: dict[str, tuple[float, float]] = {}  # id -> (seen, sshd started)
        self.env: dict[str, str] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._watcher: threading.Thread | None = None
        self._lock = threading.Lock()
        self._next = 0
        self._ended: set[str] = set()  # instances seen terminated (and their hosts stopped)
        self._ended_cond = threading.Condition()
        self.watcher_error: BaseException | None = None
        self.impostor = False
        """Instances boot with a host key of their own instead of the user-data's one
        (someone in the middle)."""
        self.hidden: tuple[str, ...] = ()
        """Files of this machine that instances booting from now on lack (each an empty
        file there, in their sshd's mount namespace: see ``Lab.add_host``)."""
        self.sshd_started: Callable[[TestHost], None] | None = None
        """Called with an instance's host as its sshd daemon starts (``bench_nodestart``
        moves the daemon into a cgroup of its own there, to count what it starts)."""

    # -- life cycle ------------------------------------------------------------------
    def start(self) -> None:
        from moto.server import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        if AwsLab.running is not None:  # moto's state is the process's: see aws_shared_lab_fixture
            raise LabError("another AwsLab runs in this process (each would boot both's instances)")
        AwsLab.running = self
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.lab.start()
        addr = f"{self.lab.subnet}.1"
        self.faults = Faults(DomainDispatcherApplication(create_backend_app), {})
        self.faults.on_change = self._wake.set
        self.server = make_server(addr, 0, self.faults, threaded=True)
        threading.Thread(target=self.server.serve_forever, args=(SERVE_POLL,), daemon=True).start()
        self.endpoint = f"http://{addr}:{self.server.server_port}"
        self.env = {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",
            "XDG_CACHE_HOME": str(self.lab.tmp / "cache"),  # the instance type catalog
        }
        self._setup_region()
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="aws-lab-watcher")
        self._watcher.start()

    def close(self) -> None:
        """Stop every instance's host and the emulator; LabError if a process an instance
        started (its boot guard, what its ``bootcmd`` left) outlived its host: an orphan on
        this machine (it is killed first), or if a pool was left alive to the lab's end
        (:meth:`end_orphan_pools`)."""
        with self.environment():  # (a lab several tests share is closed outside theirs)
            pools = self.end_orphan_pools()
        with self._lock:  # no instance is followed from now on (see _follow)
            self._stop.set()
        self._wake.set()
        if self._watcher is not None:
            self._watcher.join(5)
        for inst in list(self.instances.values()):
            self._shutdown(inst)
        if self.server is not None:
            self.server.shutdown()
            self.server = None
        self.lab.close()
        left = self.leftovers(self.instances)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if AwsLab.running is self:
            AwsLab.running = None
        if left:
            raise LabError(f"processes of the lab's instances outlived them: {left}")
        if pools:
            raise LabError(
                f"AWS pools left alive to the lab's end (orphans: a test or fixture that "
                f"started them never released them): {'; '.join(pools)}"
            )

    def end_orphan_pools(self) -> list[str]:
        """Give back, while the emulator still answers, every AWS pool still on this
        process's ledger (``flotilla._providers.ledger``): only a pool nobody released is
        there (the process's exit would give it back, after the emulator is gone: "cannot
        reach the AWS API"). Each one said: its pool id and what it created."""
        from flotilla._providers import ledger
        from flotilla._providers.aws.pool import AWSAllocation

        said = []
        for pool in ledger.pending():
            if isinstance(pool, AWSAllocation):
                what = ", ".join(sorted({what for what, _ in pool.created}))
                said.append(f"pool {pool.spec.pool_id} (tag {pool.tag}: {what})")
                try:
                    pool.end_now()
                except Exception as e:  # the others all the same
                    said[-1] += f", not given back: {e}"
        return said

    def leftovers(self, instance_ids: Iterable[str]) -> dict[int, str]:
        """Live processes of the instances ``instance_ids`` on this machine, pid ->
        command line: those with the instance's ``INSTANCE_ID`` in their environment,
        which cloud-init's ``bootcmd`` runs with (the boot guard and its ``sleep``). Empty
        once the instances' hosts are stopped."""
        wanted = {f"INSTANCE_ID={i}".encode() for i in instance_ids}
        found: dict[int, str] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    env = set(f.read().split(b"\0"))
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:  # gone meanwhile
                continue
            if env & wanted and cmdline:  # (a zombie has no command line: it is dead)
                found[int(entry)] = cmdline
        return found

    def environment(self) -> contextlib.AbstractContextManager[None]:
        return environment(self.env)

    def client(self, service: str = "ec2") -> Any:
        """A boto3 client of the emulator (whatever ``os.environ`` holds: the watcher
        thread and a shared lab's start run outside every test's environment)."""
        import boto3

        return boto3.client(
            service,
            region_name=REGION,
            endpoint_url=self.endpoint,
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
        )

    def _setup_region(self) -> None:
        """The default VPC on the bridge's /24 (two /25 subnets, zones a and b), and the
        public AMI parameters."""
        from moto.ssm.models import Parameter, ssm_backends

        ec2 = self.client()
        vpc = ec2.describe_vpcs(Filters=[{"Name": "isDefault", "Values": ["true"]}])["Vpcs"][0]
        for subnet in ec2.describe_subnets()["Subnets"]:
            ec2.delete_subnet(SubnetId=subnet["SubnetId"])
        # moto's state lives in this process: an earlier lab's block goes (a VPC holds 5)
        for block in vpc.get("CidrBlockAssociationSet", []):
            if block["CidrBlock"] != vpc["CidrBlock"]:
                ec2.disassociate_vpc_cidr_block(AssociationId=block["AssociationId"])
        ec2.associate_vpc_cidr_block(VpcId=vpc["VpcId"], CidrBlock=f"{self.lab.subnet}.0/24")
        for zone, half in zip(ZONES, ("0/25", "128/25"), strict=True):
            subnet = ec2.create_subnet(
                VpcId=vpc["VpcId"], CidrBlock=f"{self.lab.subnet}.{half}", AvailabilityZone=zone
            )["Subnet"]["SubnetId"]
            self.subnets[zone] = subnet
            assert self.faults is not None
            self.faults.zone_of[subnet] = zone
        self._reuse_addresses_when_free()
        images = ec2.describe_images(Owners=["amazon"])["Images"]
        self.ami = next(i["ImageId"] for i in images if i["Architecture"] == "x86_64")
        backend = ssm_backends[ACCOUNT][REGION]
        for name in (UBUNTU_PARAM, GPU_PARAM):
            backend._parameters[name].append(
                Parameter(
                    account_id=ACCOUNT,
                    name=name,
                    value=self.ami,
                    parameter_type="String",
                    description=None,
                    allowed_pattern=None,
                    keyid=None,
                    last_modified_date=_utcnow(),
                    version=1,
                    data_type="aws:ec2:image",
                )
            )

    def _reuse_addresses_when_free(self) -> None:
        """EC2 gives a terminated instance's private address to a new instance once the old
        one's network interface is gone; moto hands it out again at once, while the lab may
        still be stopping the old instance's host at that address (with pools of dozens of
        instances, closed and opened in a row, the new instance's SSH then reached the old
        host, another host key: REFUSED). The lab's subnets skip the addresses of instances
        whose hosts are not gone yet (they are handed out once they are)."""
        from moto.ec2.models import ec2_backends

        backend = ec2_backends[ACCOUNT][REGION]
        for subnet_id in self.subnets.values():
            subnet = backend.get_subnet(subnet_id)
            original = subnet.get_available_subnet_ip

            def pick(instance: Any, subnet: Any = subnet, original: Any = original) -> str:
                with self._ended_cond:
                    ended = set(self._ended)
                busy = {i.addr for k, i in list(self.instances.items()) if k not in ended}
                skipped: list[str] = []
                try:
                    while True:  # moto raises StopIteration when the subnet is full
                        addr = str(original(instance))
                        if addr not in busy:
                            return addr
                        subnet._subnet_ips.pop(addr, None)  # not this one: moto's books
                        skipped.append(addr)
                finally:
                    subnet._unused_ips.update(skipped)  # free again for later launches

            subnet.get_available_subnet_ip = pick  # type: ignore[method-assign]

    # -- what tests use --------------------------------------------------------------
    def provider(self, **kwargs: Any) -> Any:
        """A flotilla AWS provider for this region: root login, private addresses, a
        harmless power-off command that records when it fired and who ran it (see
        :meth:`poweroffs`)."""
        from flotilla._providers.aws import AWS

        return AWS(**self.provider_options(**kwargs))

    def provider_options(self, **kwargs: Any) -> dict[str, Any]:
        """The options of :meth:`provider` (JSON: another process can build it, with the
        lab's environment, e.g. ``bench/bench_nodestart.py --aws``)."""
        options: dict[str, Any] = {
            "region": REGION,
            "ssh_user": "root",
            "private_ips": True,
            "workdir": str(self.lab.tmp / "workdir"),
            "poweroff_command": [
                "sh",
                "-c",
                f"echo $(date +%s.%N) ${{FLOTILLA_BOOT_GUARD:+guard}} "
                f">> {self.lab.tmp}/poweroff-$(hostname)",
            ],
            "connect_timeout": 5.0,
        }
        options.update(kwargs)
        return options

    def fail_launches(
        self,
        code: str,
        market: str | None = None,
        zone: str | None = None,
        times: int | None = None,
    ) -> None:
        assert self.faults is not None
        with self.faults.lock:
            self.faults.rules.append(Rule(code, market, zone, times))

    def fail_starts(self, code: str, times: int | None = None) -> None:
        """StartInstances answers ``code`` (``times`` times; None: always)."""
        assert self.faults is not None
        with self.faults.lock:
            self.faults.rules.append(Rule(code, times=times, action="StartInstances"))

    def clear_faults(self) -> None:
        assert self.faults is not None
        with self.faults.lock:
            self.faults.rules.clear()

    def interrupt(self, instance_id: str, action: str = "terminate") -> None:
        """Announce a spot interruption in the instance's metadata."""
        inst = self.instances[instance_id]
        assert inst.host is not None
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 120))
        path = inst.host.folder / "instance-action"
        path.write_text(f'{{"action": "{action}", "time": "{when}"}}')

    def describe(self, **filters: Any) -> list[dict[str, Any]]:
        reply = self.client().describe_instances(**filters)
        return [i for r in reply["Reservations"] for i in r["Instances"]]

    def pool_instances(self, pool_id: str) -> list[dict[str, Any]]:
        return self.describe(Filters=[{"Name": "tag:flotilla:pool", "Values": [pool_id]}])

    def pool_groups(self, pool_id: str) -> list[dict[str, Any]]:
        return self.client().describe_security_groups(
            Filters=[{"Name": "tag:flotilla:pool", "Values": [pool_id]}]
        )["SecurityGroups"]

    def wait_booted(self, instance_id: str, timeout: float = 20.0) -> Instance:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            inst = self.instances.get(instance_id)
            if inst is not None and inst.host is not None and inst.host.sshd is not None:
                return inst
            time.sleep(0.02)
        raise LabError(f"{instance_id} did not boot within {timeout:g} s")

    # -- the watcher -----------------------------------------------------------------
    def _watch(self) -> None:
        """Follow the instances: woken by the emulator after every request that changes
        an instance's state (and once a second), it asks for the instances not yet
        terminated only: the emulator keeps terminated ones, and describing every instance
        of a long test session 20 times a second would take the CPU the tests need."""
        ec2 = self.client()
        while not self._stop.is_set():
            self._wake.wait(1.0)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                reply = ec2.describe_instances(
                    Filters=[{"Name": "instance-state-name", "Values": _LIVE}]
                )
                live = set()
                seen = time.monotonic()  # every new instance of the answer was seen now
                for inst in (i for r in reply["Reservations"] for i in r["Instances"]):
                    live.add(inst["InstanceId"])
                    self._follow(ec2, inst, seen)
                for ident in [i for i in self.instances if i not in live]:
                    self._end(ident)  # terminated: not listed any more
            except BaseException as e:  # shown by tests that check watcher_error
                if self._stop.is_set():
                    return
                self.watcher_error = e

    def _end(self, ident: str) -> None:
        """``ident`` is terminated (or stopped): stop its host, once."""
        if ident in self._ended:
            return
        known = self.instances.get(ident)
        if known is not None:
            self._shutdown(known)
        with self._ended_cond:
            self._ended.add(ident)
            self._ended_cond.notify_all()

    def _follow(self, ec2: Any, desc: dict[str, Any], seen: float) -> None:
        ident, state = desc["InstanceId"], desc["State"]["Name"]
        known = self.instances.get(ident)
        if state in ("shutting-down", "terminated"):
            self._end(ident)
            return
        if state in ("stopping", "stopped"):
            if known is not None and not known.off:
                self._power_off(known)
            return
        if known is not None:
            if known.off:  # started again
                known.off = False
                self.power[(ident, "start")] += 1
                threading.Thread(target=self._restart, args=(known,), daemon=True).start()
            return
        inst = Instance(ident, desc["PrivateIpAddress"], seen=seen)
        with self._lock:  # a host made after close() stopped them all would run on
            if self._stop.is_set():
                return
            self.instances[ident] = inst
        threading.Thread(target=self._life, args=(inst, ec2), daemon=True).start()

    def _life(self, inst: Instance, ec2: Any) -> None:
        """An instance's boot, as EC2 does it: its network interface (address, metadata
        service) is there at once, its sshd (configured from the user-data as cloud-init
        would) answers ``boot_delay`` seconds after the launch was seen. Each instance
        reads its own user-data (as cloud-init does at boot): the watcher, one thread for
        every instance, does not wait for 64 of them one after the other."""
        try:
            data = ec2.describe_instance_attribute(
                InstanceId=inst.instance_id, Attribute="userData"
            )
        except BaseException as e:
            if not inst.stopped.is_set() and not self._stop.is_set():
                self.watcher_error = e
            return
        user_data = base64.b64decode(data.get("UserData", {}).get("Value", "") or b"").decode()
        with inst.lock:
            if inst.stopped.is_set():  # terminated before it got its network
                return
            self._network(inst, user_data)
            boot = inst.boot
        self._sshd_after_boot(inst, boot)

    def _sshd_after_boot(self, inst: Instance, boot: int) -> None:
        """Start the instance's sshd ``boot_delay`` s after it was seen, unless it was
        terminated or stopped meanwhile."""
        if inst.stopped.wait(max(0.0, inst.seen + self.boot_delay - time.monotonic())):
            return
        with inst.lock:
            if not inst.stopped.is_set() and inst.host is not None and inst.boot == boot:
                inst.host.hidden = self.hidden
                self.lab.start_sshd(
                    # the instance's bootcmd (boot guard, watchdog) runs in this machine's
                    # mount namespace (_bootcmd): its sshd shares that file system view
                    inst.host,
                    inst.host.folder / "authorized_keys",
                    wait=False,
                    own_files=False,
                )
                if self.sshd_started is not None:
                    self.sshd_started(inst.host)
                self.booted.append(inst.instance_id)
                self.boot_times[inst.instance_id] = (inst.seen, time.monotonic())

    def _power_off(self, inst: Instance) -> None:
        """The instance is stopped: everything running in its host ends (a powered-off
        machine); the host (address, folder, host key: the disk) stays."""
        with inst.lock:
            inst.off = True
            inst.boot += 1
            self.power[(inst.instance_id, "stop")] += 1
            host = inst.host
            if host is None:
                return
            self.lab.kill_all(host)
            if host.sshd is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    host.sshd.wait(5)
                host.sshd = None
            if host._log is not None:
                host._log.close()
                host._log = None
            if inst.imds is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    inst.imds.wait(5)
                inst.imds = None

    def _restart(self, inst: Instance) -> None:
        """A stopped instance was started: it boots again as at its launch (metadata
        service, bootcmd, then sshd with the host key on its disk)."""
        with inst.lock:
            if inst.stopped.is_set() or inst.host is None or inst.off:
                return
            inst.seen = time.monotonic()
            self._boot_services(inst)
            boot = inst.boot
        self._sshd_after_boot(inst, boot)

    def _network(self, inst: Instance, user_data: str) -> None:
        with self._lock:
            self._next += 1
            i = self._next
        config = yaml.safe_load(user_data) if user_data.startswith("#cloud-config") else {}
        host = self.lab.new_host(
            100 + i, inst.addr, f"ip-{inst.addr.replace('.', '-')}", ("169.254.169.254",)
        )
        inst.host = host
        keys = config.get("ssh_keys", {})
        hostkey = host.folder / "hostkey"
        if self.impostor:
            host.pubkey = keygen(hostkey, "impostor")
        else:
            hostkey.write_text(keys["ed25519_private"])
            hostkey.chmod(0o600)
            host.pubkey = keys["ed25519_public"]
        authorized = host.folder / "authorized_keys"
        authorized.write_text("".join(k + "\n" for k in config.get("ssh_authorized_keys", [])))
        inst.user_data = config
        self._boot_services(inst)

    def _boot_services(self, inst: Instance) -> None:
        """What every boot runs before sshd: the metadata service, then bootcmd."""
        host = inst.host
        assert host is not None
        inst.imds = subprocess.Popen(
            [
                *_in_netns(host.netns),
                sys.executable,
                "-c",
                _IMDS,
                str(host.folder),
                inst.instance_id,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert inst.imds.stdout is not None
        inst.imds.stdout.readline()  # "ready": the metadata service answers before sshd
        self._poweroff_file(inst.addr).unlink(missing_ok=True)  # a former boot's
        self._bootcmd(inst, inst.user_data.get("bootcmd") or [])

    def _bootcmd(self, inst: Instance, commands: list[Any]) -> None:
        """Run the user-data's ``bootcmd`` in the instance as cloud-init does: the entries
        as one shell script (strings as they are, lists as quoted words), ``/bin/sh`` as
        root with ``INSTANCE_ID`` in the environment, waiting for the script (not for what
        it starts in the background). The host's hostname is the instance's."""
        host = inst.host
        assert host is not None
        inst.console = host.folder / "console.log"
        if not commands:
            return
        lines = [
            c if isinstance(c, str) else " ".join(shlex.quote(str(w)) for w in c) for c in commands
        ]
        script = host.folder / "bootcmd.sh"
        script.write_text("#!/bin/sh\n" + "".join(line + "\n" for line in lines))
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
        inst.bootcmd_at = time.time()
        with open(inst.console, "ab") as console:
            proc = subprocess.Popen(
                [
                    *_in_netns(host.netns),
                    "unshare",
                    "--uts",
                    "sh",
                    "-c",
                    f'hostname {host.hostname} && exec /bin/sh "$0"',
                    str(script),
                ],
                stdin=subprocess.DEVNULL,
                stdout=console,
                stderr=console,
                env={**env, "INSTANCE_ID": inst.instance_id},
                cwd="/",
            )
        # as with cloud-init, sshd (so the agent) comes after the whole script, however busy
        # the machine is: a boot guard still running when the agent starts would remove the
        # contact file the agent just made, as a former boot's (with the 30 s cap this wait
        # had, sshd could start first). A termination meanwhile waits for it too (the lock):
        # the script is in the host when the host's removal kills what runs there.
        proc.wait()

    def _shutdown(self, inst: Instance) -> None:
        """The instance is terminated: stop its host and everything in it."""
        inst.stopped.set()
        with inst.lock:  # waits for a network set-up or boot under way
            host = inst.host
            if host is not None and host in self.lab.hosts:
                with contextlib.suppress(Exception):
                    self.lab.remove_host(host)
            if inst.imds is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    inst.imds.wait(5)
            inst.host = None

    def wait_ended(self, instance_id: str, timeout: float = 30.0) -> bool:
        """Wait until the watcher saw ``instance_id`` terminated and stopped its host."""
        with self._ended_cond:
            return self._ended_cond.wait_for(lambda: instance_id in self._ended, timeout)

    def host_of(self, instance_id: str) -> TestHost | None:
        inst = self.instances.get(instance_id)
        return inst.host if inst else None

    def poweroffs(self, addr: str, by: str | None = None) -> list[float]:
        """When the harmless power-off command of the instance at ``addr`` ran (since that
        instance booted), by anyone or ``by`` ``"guard"`` (the boot guard) or
        ``"watchdog"``."""
        try:
            text = self._poweroff_file(addr).read_text()
        except OSError:
            return []
        times = []
        for line in text.splitlines():
            words = line.split()
            if words and by in (None, words[1] if len(words) > 1 else "watchdog"):
                times.append(float(words[0]))
        return times

    def _poweroff_file(self, addr: str) -> Path:
        return self.lab.tmp / f"poweroff-ip-{addr.replace('.', '-')}"

    def console(self, instance_id: str) -> str:
        """The instance's console log: what its cloud-init commands wrote."""
        inst = self.instances.get(instance_id)
        if inst is None or inst.console is None:
            return ""
        try:
            return inst.console.read_text(errors="replace")
        except OSError:
            return ""


def _utcnow() -> Any:
    import datetime

    return datetime.datetime.now(datetime.UTC)


def aws_unavailable() -> str | None:
    """Why no AWS lab can be built here (None: it can)."""
    reason = lab_unavailable()
    if reason:
        return reason
    try:
        import boto3  # noqa: F401
        import moto.server  # noqa: F401
    except ImportError as e:
        return f"the AWS tests need boto3 and moto[server] (pip install 'flotilla[dev]'): {e}"
    return None


_AWS = SharedLab(lambda: AwsLab().started())


@pytest.fixture(scope="session", name="aws_shared_lab")
def aws_shared_lab_fixture() -> Iterator[AwsLab]:
    """The process's one ``AwsLab``, however many test modules import this fixture: pytest
    makes a session-scoped fixture once per module that defines it (each import is a
    definition), and two labs in one process share moto's EC2 state (it lives in the
    process), so each booted the other's instances too: a second boot, whose boot guard
    removed the contact file of the agent the first boot's host already ran (issue 39's
    instances that never ended, test_fallback's agent that died at its start). The last
    user closes it. Tests ask for ``aws_lab``."""
    reason = aws_unavailable()
    if reason:
        pytest.skip(reason)
    with _AWS.use() as lab:
        yield lab


@pytest.fixture(name="aws_lab")
def aws_lab_fixture(aws_shared_lab: AwsLab) -> Iterator[AwsLab]:
    """The process's ``AwsLab`` for one test: its environment (``AWS_*`` pointing boto3 at
    the emulator) in ``os.environ`` while the test runs, as it was before afterwards (the
    lab lives on, the next test may not know it)."""
    with aws_shared_lab.environment():
        yield aws_shared_lab
