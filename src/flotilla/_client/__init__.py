"""Client side of a pool: the API's calls, dispatch and node handles."""
