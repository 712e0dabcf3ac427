"""``python -m flotilla.agent``: the node agent every provider starts (see ``flotilla._node``)."""

from ._node.agent import main

if __name__ == "__main__":
    main()
