"""The Kubernetes provider's settings: one frozen object, checked when made (before anything
starts). Light to import: the command line derives its flags from it."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ..._errors import ConfigurationError, check_number, check_text
from ..options import From, docker_image, option

_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


@dataclass(frozen=True)
class KubernetesSettings:
    """Where and how the Kubernetes provider runs a pool's pods; checked when made.

    Attributes:
        namespace: the namespace of the pool's pods.
        context: the kubeconfig context (default: the kubeconfig's current context).
        kubeconfig: the kubeconfig file (default: ``$KUBECONFIG``, else ``~/.kube/config``,
            else the pod's service account when the client itself runs in a pod).
        python: interpreter in the pods' image, of the client's Python minor version
            (default: ``python3``, or, when that is another minor version, one found there;
            see docs/guide.md, "Python on the nodes"). Given, it is only checked.
        image: the pods' container image (default: ``python:<client's X.Y>-slim``). It
            needs a Python interpreter; no SSH daemon.
        workdir: folder in the pods for flotilla's files and the agents' working directory.
        pending_timeout: seconds a pod may stay unschedulable (the scheduler's
            FailedScheduling) before the pool gives up naming the shortage (default: 15 s,
            or 600 s with ``autoscaler``).
        autoscaler: the cluster has an autoscaler that adds nodes for pending pods: wait
            for it (up to ``pending_timeout``) instead of failing fast.
        gpu_label: node label naming the GPU type, used to select nodes when the
            accelerator names one (``A100:8`` selects ``<gpu_label>=a100``); None: only
            ``nvidia.com/gpu`` is requested, on any GPU node.
        kubectl: the kubectl command (every API call and exec stream goes through it).
    """

    namespace: str = option("default", flag="--namespace")
    context: str | None = option(None, flag="--context", task="infra")
    kubeconfig: str | None = option(None, flag="--kubeconfig")
    python: str | None = None
    image: str | None = option(None, task=From(("image_id",), docker_image))
    workdir: str = "~/.flotilla"
    pending_timeout: float | None = option(None, flag="--pending-timeout")
    autoscaler: bool = option(False, flag="--autoscaler")
    gpu_label: str | None = option("skypilot.co/accelerator", flag="--gpu-label")
    kubectl: str = option("kubectl", flag="--kubectl")

    def __post_init__(self) -> None:
        if not isinstance(self.namespace, str) or not _NAME.fullmatch(self.namespace):
            raise ConfigurationError(
                f"Kubernetes(namespace=...) must be a namespace name (lowercase letters, "
                f"digits and '-'), got {self.namespace!r}"
            )
        for key in ("context", "kubeconfig", "python", "image", "gpu_label"):
            value = getattr(self, key)
            message = f"Kubernetes({key}=...) must be a non-empty string or None, got {value!r}"
            check_text(value, message, or_none=True)
        for key in ("workdir", "kubectl"):
            value = getattr(self, key)
            check_text(value, f"Kubernetes({key}=...) must be a non-empty string, got {value!r}")
        check_number(
            self.pending_timeout,
            f"Kubernetes(pending_timeout=...) must be a positive number of seconds or "
            f"None, got {self.pending_timeout!r}",
            above=0,
            or_none=True,
        )
        if not isinstance(self.autoscaler, bool):
            raise ConfigurationError(
                f"Kubernetes(autoscaler=...) must be True or False, got {self.autoscaler!r}"
            )
        if self.kubeconfig is not None:
            object.__setattr__(self, "kubeconfig", os.path.expanduser(self.kubeconfig))

    @property
    def pending_limit(self) -> float:
        """Seconds a pod may stay unschedulable."""
        if self.pending_timeout is not None:
            return float(self.pending_timeout)
        return 600.0 if self.autoscaler else 15.0
