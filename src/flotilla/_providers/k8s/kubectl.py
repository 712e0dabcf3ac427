"""kubectl as the Kubernetes provider's one client: API calls (create, get, delete) and the
agents' exec streams.

Why kubectl rather than a Python client: the exec streams need it anyway (SPDY, which no
standard-library module speaks, and which every API server version serves), and going
through it for everything gives one authentication path, the user's own: kubeconfig
contexts, client certificates, tokens and the exec credential plugins that managed clusters
use (``gke-gcloud-auth-plugin``, ``aws eks get-token``, ``kubelogin``). No Python dependency
is added, and what fails is said in kubectl's own words.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from typing import Any

from ..._errors import ConfigurationError, ProvisionError
from ..retry import retried_async
from .settings import KubernetesSettings

CALL_TIMEOUT = 60.0
"""Seconds one kubectl API call may take."""


class Kubectl:
    """kubectl with the provider's kubeconfig, context and namespace."""

    def __init__(self, settings: KubernetesSettings) -> None:
        self.settings = settings
        self.namespace = settings.namespace

    @property
    def path(self) -> str:
        return shutil.which(self.settings.kubectl) or self.settings.kubectl

    def base(self) -> list[str]:
        """kubectl and its global flags (kubeconfig, context)."""
        argv = [self.path]
        if self.settings.kubeconfig is not None:
            argv.append(f"--kubeconfig={self.settings.kubeconfig}")
        if self.settings.context is not None:
            argv.append(f"--context={self.settings.context}")
        return argv

    def check_local(self) -> None:
        """ConfigurationError when kubectl or the kubeconfig (and its context) is missing;
        runs nothing remote."""
        if shutil.which(self.settings.kubectl) is None:
            raise ConfigurationError(
                f"the Kubernetes provider runs kubectl, and {self.settings.kubectl!r} is not "
                "on PATH: install kubectl (of a version within one minor of the cluster's) or "
                "pass Kubernetes(kubectl=...)"
            )
        config = self.settings.kubeconfig
        if config is not None:
            if not os.path.isfile(config):
                raise ConfigurationError(f"Kubernetes(kubeconfig=...): no such file: {config}")
        elif (
            not os.environ.get("KUBECONFIG")
            and not os.path.isfile(os.path.expanduser("~/.kube/config"))
            and not os.environ.get("KUBERNETES_SERVICE_HOST")
        ):
            raise ConfigurationError(
                "no kubeconfig: pass Kubernetes(kubeconfig=...), set $KUBECONFIG or write "
                "~/.kube/config (e.g. with your cloud's `get-credentials` command)"
            )
        if self.settings.context is not None:
            argv = [*self.base(), "config", "get-contexts", "-o", "name"]
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
            names = proc.stdout.split()
            if proc.returncode != 0 or self.settings.context not in names:
                raise ConfigurationError(
                    f"Kubernetes(context={self.settings.context!r}): the kubeconfig has no such "
                    f"context (it has: {', '.join(names) or 'none'})"
                )

    async def run(
        self, args: Sequence[str], *, stdin: bytes | None = None, namespaced: bool = True
    ) -> tuple[int, str, str]:
        """Run ``kubectl args``; (exit status, stdout, stderr)."""
        argv = [*self.base(), *(["-n", self.namespace] if namespaced else []), *args]
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            async with asyncio.timeout(CALL_TIMEOUT):
                out, err = await proc.communicate(stdin)
        except BaseException:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            raise
        assert proc.returncode is not None
        return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")

    async def call(self, args: Sequence[str], *, stdin: bytes | None = None) -> str:
        """``kubectl args``'s output; ProvisionError with kubectl's words when it fails.
        A transient failure (the API server restarting, a dropped connection: see
        ``retry``) is tried again; a create tried again takes the objects it finds
        already made (by the attempt whose answer was lost) as made."""
        attempts = 0

        async def once() -> str:
            nonlocal attempts
            attempts += 1
            status, out, err = await self.run(args, stdin=stdin)
            if status != 0:
                lines = [line for line in err.splitlines() if line.strip()]
                made = args[0] == "create" and attempts > 1
                if made and lines and all("(AlreadyExists)" in line for line in lines):
                    return out
                raise ProvisionError(f"kubectl {args[0]} failed: {said(err)}")
            return out

        return await retried_async(once, f"kubectl {args[0]}")

    async def get(self, kind: str, selector: str) -> list[dict[str, Any]]:
        """The objects of ``kind`` matching the label ``selector``."""
        out = await self.call(["get", kind, "-l", selector, "-o", "json"])
        items: list[dict[str, Any]] = json.loads(out).get("items", [])
        return items

    async def create(self, objects: Sequence[dict[str, Any]]) -> None:
        """Create ``objects`` (one call)."""
        doc = {"apiVersion": "v1", "kind": "List", "items": list(objects)}
        await self.call(["create", "-f", "-", "-o", "name"], stdin=json.dumps(doc).encode())

    def watch(self, kind: str, selector: str) -> Watch:
        """A watch of the objects of ``kind`` matching ``selector`` (not started)."""
        return Watch(self, kind, selector)

    async def delete(self, kinds: str, selector: str, *, wait: bool = True) -> None:
        """Delete the objects of ``kinds`` (``pods,secrets``) matching ``selector``; with
        ``wait``, until they are gone."""
        args = [
            "delete",
            kinds,
            "-l",
            selector,
            "--ignore-not-found",
            f"--wait={str(wait).lower()}",
        ]
        await self.call(args)

    def delete_now(self, kinds: str, selector: str, wait: bool = False) -> None:
        """:meth:`delete` (by default without waiting), synchronously (no event loop)."""
        argv = [*self.base(), "-n", self.namespace, "delete", kinds, "-l", selector]
        argv += ["--ignore-not-found", f"--wait={str(wait).lower()}"]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=120 if wait else 60)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ProvisionError(f"kubectl delete failed: {e}") from None
        if proc.returncode != 0:
            raise ProvisionError(f"kubectl delete failed: {said(proc.stderr)}")


class Watch:
    """``kubectl get KIND -l SELECTOR --watch``: the changes of the matching objects as
    they happen (first one ADDED per existing object), from one kubectl process."""

    def __init__(self, kubectl: Kubectl, kind: str, selector: str) -> None:
        self.argv = [
            *kubectl.base(),
            "-n",
            kubectl.namespace,
            "get",
            kind,
            "-l",
            selector,
            "-o",
            "json",
            "--watch",
            "--output-watch-events",
        ]
        self.proc: asyncio.subprocess.Process | None = None
        self.text = ""
        self.decoder = json.JSONDecoder()

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )

    def _decoded(self) -> tuple[str, dict[str, Any]] | None:
        text = self.text.lstrip()
        try:
            event, end = self.decoder.raw_decode(text)
        except json.JSONDecodeError:
            self.text = text
            return None  # not whole yet
        self.text = text[end:]
        return str(event.get("type", "")), event.get("object") or {}

    async def next(self, timeout: float) -> tuple[str, dict[str, Any]] | None:
        """The next event (type, object), or None when none came within ``timeout`` s.
        EOFError when the watch ended (kubectl exited)."""
        assert self.proc is not None and self.proc.stdout is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (event := self._decoded()) is None:
            try:
                async with asyncio.timeout_at(deadline):
                    chunk = await self.proc.stdout.read(1 << 16)
            except TimeoutError:
                return None
            if not chunk:
                raise EOFError("the watch ended")
            self.text += chunk.decode(errors="replace")
        return event

    async def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


def said(stderr: str) -> str:
    """kubectl's message, on one line."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    return "; ".join(lines[-3:]) or "(no message)"
