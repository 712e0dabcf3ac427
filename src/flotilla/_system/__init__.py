"""The bottom helpers every layer shares, standard library only.

    procs.py    the one process-table walk (/proc): start times, liveness, reaping
    locks.py    the one flock helper (node side and command line)
    private.py  the private folders and files (0700/0600, verified) under the user's home
    untar.py    the one safe archive extraction (includes, workdir sync)
    s3.py       the standard-library S3 client (SigV4): volumes and flotilla.storage
    mounts.py   detach the mounts under a folder before it is removed

They import nothing of flotilla but ``flotilla._errors``: the node side, the providers, the
client and the command line all use them (tests/test_layers.py checks both).
"""
