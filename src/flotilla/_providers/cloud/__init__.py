"""The cloud kit: what every provider of rented instances reached over SSH shares (AWS,
Vast.ai, RunPod, Lambda Cloud and the GPU markets to come).

* ``keys``: SSH keys made by the client (ssh-keygen), pinned in a pool's own known_hosts:
  no trust on first use;
* ``guard``: the boot guard, an instance no client reaches powers itself off;
* ``identity``: the client's identity (``host:pid:start``) written on what a pool rents,
  and whether that client still runs (orphans);
* ``boot``: waiting for an instance's SSH port, and which failures of a booting instance
  are tried again;
* ``rest``: a cloud's JSON API over HTTP (standard library only): retries, the key never
  shown, a refused key a ConfigurationError naming where it came from;
* ``market``: a rented-instance provider's settings plumbing, checks before renting, its
  labels ``flotilla:{pool}:{client}`` and the orphan pools found by them;
* ``allocation``: :class:`~flotilla._providers.cloud.allocation.CloudAllocation`, the
  allocation of instances reached over SSH with their host keys pinned, whose shell's
  ``transient()`` tries a booting instance again (the launch layer's retry); and
  :class:`~flotilla._providers.cloud.allocation.InstanceAllocation`, one whose instances
  are added, ended and replaced one at a time (elastic pools) over a provider's
  ``create_one``/``wait_one``/``machine_of``/``end_one``, each billed until it ends.

Nothing here knows a particular cloud; nothing outside ``aws/`` imports ``aws/``.
"""
