"""flotilla's main example: a 4-node pool on the local provider.

Run it with ``./dev demo``.
"""

import flotilla as sky


@sky.function
def where_am_i(data: list[int]) -> dict[str, object]:
    info = sky.instance_info()
    mine = sky.shard(data)
    print(f"node {info.node} of {info.total_nodes} got {len(mine)} items")
    return {"node": info.node, "head": info.is_head, "sum": sum(mine)}


@sky.function
def square(x: int) -> int:
    return x * x


def main() -> None:
    data = list(range(1000))
    with sky.Compute(nodes=4) as pool:
        results = where_am_i(data) @ pool  # every node, results in rank order
        assert sum(r["sum"] for r in results) == sum(data)
        print("broadcast:", results)
        print("one node:", square(7) >> pool)  # the least busy node
        print("in parallel:", (square(2) & square(3) & square(4)) >> pool)
        print("map:", pool.map(square, range(8)))


if __name__ == "__main__":
    main()
