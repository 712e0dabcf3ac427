"""The example provider of docs/providers.md (nodes in network namespaces), taken from the
page as it is: it runs a pool through the library, and through its entry point as
`flotilla launch --provider netns` builds it. Root only (``unshare --net``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _procs import assert_all_gone

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "providers.md"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="unshare --net needs root")


def _example_package(tmp_path: Path) -> Path:
    """A folder with the page's example module (``flotilla_netns``) and the metadata of a
    package that registers it in the entry-point group ``flotilla.providers``."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    module = next(b for b in blocks if b.startswith('"""flotilla_netns'))
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "flotilla_netns.py").write_text(module)
    info = tmp_path / "flotilla_netns-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flotilla-netns\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[flotilla.providers]\nnetns = flotilla_netns:NetnsProvider\n"
    )
    return tmp_path


_PROGRAM = """
import json, os, signal
import flotilla as sky
from flotilla.cli.backends import registry
from flotilla.cli.parser import build_parser

@sky.function
def where():
    info = sky.instance_info()
    return info.node, info.total_nodes, os.readlink("/proc/self/ns/net")

args = build_parser().parse_args(
    ["launch", "task.yaml", "--provider", "netns", "--provider-option", "prefix={prefix}"]
)
spec = registry.spec_from_args(args)
provider = registry.backend_for(spec).make_provider(spec, None)
here = os.readlink("/proc/self/ns/net")
with sky.Compute(provider=provider, nodes=2) as pool:
    seen = where() @ pool
    names = sorted(m.ident for m in pool._allocation.machines)
    pids = [n.hello_info["pid"] for n in pool._nodes]
print(json.dumps({{"kind": spec.kind, "seen": seen, "here": here, "names": names, "pids": pids}}))
"""


def test_the_example_provider_runs_a_pool_through_its_entry_point(tmp_path: Path) -> None:
    """The provider is found by its entry point, gets its settings from
    --provider-option, and runs a two-node pool whose nodes are in two namespaces (not
    the client's); no agent is left after the pool."""
    import json

    package = _example_package(tmp_path / "pkg")
    prefix = f"fx{os.getpid()}"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(package), str(ROOT / "src")]),
        FLOTILLA_HOME=str(tmp_path / "home"),
    )
    done = subprocess.run(
        [sys.executable, "-c", _PROGRAM.format(prefix=prefix)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["kind"] == "netns"
    assert [node for node, _, _ in result["seen"]] == [0, 1]
    assert {total for _, total, _ in result["seen"]} == {2}
    spaces = {ns for _, _, ns in result["seen"]}
    assert len(spaces) == 2 and result["here"] not in spaces  # each node in its own
    assert all(name.startswith(prefix + "-") for name in result["names"])
    assert_all_gone(result["pids"], timeout=10, what="the agents")  # their namespaces too


def test_the_example_provider_refuses_bad_settings_before_anything_starts(
    tmp_path: Path,
) -> None:
    """A bad setting is a ConfigurationError when the provider is made: no namespace."""
    package = _example_package(tmp_path / "pkg")
    sys.path.insert(0, str(package))
    try:
        import flotilla_netns  # type: ignore[import-not-found]

        with pytest.raises(ValueError, match="letters and digits only"):
            flotilla_netns.NetnsProvider(prefix="no good")
    finally:
        sys.path.remove(str(package))
        sys.modules.pop("flotilla_netns", None)
