"""``flotilla config show|validate``: the configuration files (``_providers.config_files``).

``show`` prints the merged configuration (the user's ``$FLOTILLA_HOME/config.yaml``, the
project's ``.flotilla.yaml`` over it) as YAML, each value with the ``file:line`` it comes
from; ``validate [FILE...]`` checks the files (default: those two), every named pool made
as ``Compute(name=...)`` would make its provider's settings, and says what the command
line leaves to ``Compute`` (fields it sets itself). A bad file is exit status 2, the
message naming the file, line, key and what is allowed.
"""

from __future__ import annotations

import argparse
from typing import Any

from .._providers import config_files as configuration
from .backends import registry
from .console import say


def add_config_parser(sub: Any) -> None:
    """``flotilla config show|validate``."""
    q = sub.add_parser("config", help="the configuration files: provider defaults and named pools")
    actions = q.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = actions.add_parser(
        "show", help="the merged configuration, each value with the file and line it is from"
    )
    show.set_defaults(func=cmd_config_show)
    check = actions.add_parser("validate", help="check configuration files (default: both)")
    check.add_argument("files", nargs="*", metavar="FILE")
    check.set_defaults(func=cmd_config_validate)


def cmd_config_show(args: argparse.Namespace) -> int:

    loaded = configuration.load()
    looked = (configuration.user_file(), configuration.project_file())
    for path in looked:
        state = "read" if str(path) in loaded.files else "not there"
        print(f"# {path}: {state}")
    data = configuration.shown(loaded)
    if not data:
        print("# nothing configured")
        return 0
    for line in _lines(data, "", "", loaded):
        print(line)
    return 0


def _lines(
    data: dict[str, Any], prefix: str, indent: str, loaded: configuration.Config, above: str = ""
) -> list[str]:
    """``data`` as YAML, one key a line, each value followed by ``# file:line`` of the layer
    that set it (a pool's settings from the provider's defaults: that default's; inside a
    mapping value, the mapping's: ``above``)."""
    import yaml

    out = []
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else key
        where = loaded.origin.get(full)
        parts = full.split(".")
        if where is None and len(parts) == 4 and parts[0] == "pools" and parts[2] == "settings":
            where = loaded.origin.get(f"{loaded.pools[parts[1]].provider}.{parts[3]}")
        if isinstance(value, dict) and value:
            out.append(f"{indent}{key}:")
            out += _lines(value, full, indent + "  ", loaded, where or above)
            continue
        text = yaml.safe_dump(value, default_flow_style=True, width=1 << 20).strip()
        text = text.removesuffix("...").strip()
        where = where or above
        out.append(f"{indent}{key}: {text}" + (f"  # {where}" if where else ""))
    return out


def cmd_config_validate(args: argparse.Namespace) -> int:
    if args.files:
        layers = [configuration.read(path) for path in args.files]
    else:
        paths = [configuration.user_file(), configuration.project_file()]
        layers = [configuration.read(p) for p in paths if p.is_file()]
        if not layers:
            say(f"no configuration file: neither {paths[0]} nor {paths[1]} exists")
            return 0
    merged = configuration.merge(layers)
    for pool in merged.pools.values():
        pool.make_provider()  # the provider's own checks of its settings
        pool.image()
    for kind, values in merged.providers.items():
        fixed = registry.backend(kind).fixed
        for name in values:
            if name in fixed:
                say(
                    f"note: {merged.origin.get(f'{kind}.{name}')}: {kind}.{name} applies to "
                    f"Compute(...) only: command-line clusters set it themselves "
                    f"({fixed[name]})"
                )
    for layer in layers:
        print(f"{layer.path}: valid")
    return 0
