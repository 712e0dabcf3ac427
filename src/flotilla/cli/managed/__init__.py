"""Managed jobs (``flotilla jobs ...``, SkyPilot's ``sky jobs``): a task that runs on its own
cluster under a controller process that outlives the launching command and recovers the
job by itself when a node is lost or the program fails with restarts left.

    recovery.py     the task file's ``job_recovery`` and the decision after a failed attempt
    state.py        the jobs' records under FLOTILLA_HOME/managed (a 0700 folder)
    controller.py   the controller process: provision, run, watch, recover, tear down
    commands.py     the ``flotilla jobs`` subcommands
"""
