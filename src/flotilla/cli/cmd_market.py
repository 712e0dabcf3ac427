"""``flotilla show-gpus``, ``flotilla check`` and ``flotilla cost-report``: what the
configured providers offer, whether their credentials work, what clusters cost."""

from __future__ import annotations

import argparse
import sys

from .._errors import FlotillaError
from .console import CLIError, json_flag, print_json, say, table


def _providers(names: list[str] | None) -> list[object]:
    """The providers to ask: those named (``--provider``), else every configured one."""
    from .._providers.market import configured
    from .backends import registry

    if not names:
        return configured()
    out: list[object] = []
    for name in names:
        provider = registry.backend(name).market_provider()
        if provider is None:
            raise CLIError(f"--provider {name}: its machines exist already: no offers", code=2)
        out.append(provider)
    return out


def cmd_show_gpus(args: argparse.Namespace) -> int:
    from .._providers.market import offers

    providers = _providers(args.provider)
    if not providers:
        if args.json:
            print_json({"offers": []})
        say(
            "no provider is configured: set VAST_API_KEY (or `vastai set api-key`), or "
            "AWS credentials and a region; `flotilla check` says what is missing"
        )
        return 1
    found = offers(args.accelerator, providers=providers, nodes=args.nodes)
    if args.json:
        from dataclasses import asdict

        print_json({"offers": [asdict(o) for o in found[: args.limit]]})
        return 0 if found else 1
    if not found:
        say(f"no offer for {args.accelerator or 'any accelerator'}")
        return 1
    rows = [["PROVIDER", "ACCELERATOR", "COUNT", "$/HOUR", "REGION", "SPOT", "OFFER"]]
    for o in found[: args.limit]:
        rows.append(
            [
                o.provider,
                o.accelerator or "-",
                str(o.count),
                f"{o.hourly:.4g}" if o.hourly is not None else "unknown",
                o.region,
                "yes" if o.spot else "no",
                o.detail + (f" cluster {o.cluster}" if o.cluster else ""),
            ]
        )
    sys.stdout.write(table(rows))
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    """Which providers can be used from here, and why not."""
    from .backends import registry

    found: list[dict[str, object]] = []
    for b in registry.BACKENDS:
        if args.provider and b.kind not in args.provider:
            continue
        try:
            found.append({"provider": b.kind, "usable": True, "detail": b.check()})
        except (FlotillaError, OSError, ImportError) as e:
            found.append({"provider": b.kind, "usable": False, "detail": str(e).splitlines()[0]})
    if args.json:
        return print_json({"providers": found})
    rows = [["PROVIDER", "STATUS", "DETAIL"]]
    for p in found:
        rows.append([str(p["provider"]), "ok" if p["usable"] else "not usable", str(p["detail"])])
    sys.stdout.write(table(rows))
    return 0


def cmd_cost_report(args: argparse.Namespace) -> int:
    from .costs import report, runs

    if args.json:
        found = runs()
        total = sum(r["cost"] or 0.0 for r in found)
        return print_json({"runs": found, "total": total})
    rows = report()
    if len(rows) == 2:
        say("no cluster has run yet")
        return 0
    sys.stdout.write(table(rows))
    return 0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    q = sub.add_parser(
        "show-gpus", help="what the configured providers offer: type, count, $/hour, region"
    )
    q.add_argument("accelerator", nargs="?", help="e.g. A100 or A100:8 (default: any)")
    q.add_argument("--provider", action="append", help="ask only this one (vast, aws)")
    q.add_argument("--nodes", type=int, default=1, help="for a pool of this many nodes")
    q.add_argument("--limit", type=int, default=50, help="show at most this many offers")
    json_flag(q)
    q.set_defaults(func=cmd_show_gpus)

    q = sub.add_parser("check", help="which providers have working credentials, and why not")
    q.add_argument("--provider", action="append", help="check only this one")
    json_flag(q)
    q.set_defaults(func=cmd_check)

    q = sub.add_parser("cost-report", help="what each cluster cost (price x time)")
    json_flag(q)
    q.set_defaults(func=cmd_cost_report)
