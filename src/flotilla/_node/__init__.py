"""The node side: the agent every provider starts, its executors and environment builder.

    agent.py       the agent: the client-facing side (HELLO, CONFIG, the client's frames,
                   heartbeats, shutdown)
    environment.py the agent's environment side: the Image's build subprocess, the volumes
    supervisor.py  the executors: one process per local rank, forked, fed, watched, replaced
    processes.py   the executors' processes: fork, pipes, output forwarded, kill and close
    eventloop.py   epoll with callbacks and non-blocking writers, which the agent runs on
    batching.py    the agent's scheduling policy: SCHED_BATCH while its executors' tasks queue
    executor.py    the executor process: plugins' hooks once, then the tasks, one at a time
    hooks.py       the plugins' around_process hooks, entered by each executor
    build.py       an Image's environment, built once per content hash (a subprocess)
    interpreter.py a Python of the client's minor version on this node: found or installed

Its process, lock, private-folder and extraction helpers are ``flotilla._system``'s.
Standard library only: nodes may have nothing but Python (tests/test_layers.py checks).
"""
