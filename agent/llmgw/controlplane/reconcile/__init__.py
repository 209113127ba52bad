"""The reconciler's passes, one concern each, run in order by ``Reconciler.reconcile``.

Every module here is pure: it reads and edits the ``ReplicaBook`` and adds to
the pass's ``Plan`` (actions, events, reasons), never touching a socket or a
clock, so each rule is unit-tested with explicit times.

- ``replicacount``: each deployment's count this pass, declared or autoscaled;
- ``plan``: what a pass reads (``NodeView``, ``Context``) and writes (``Plan``,
  the ``Start``/``Stop``/``Drain`` actions);
- ``observe``: agents' reports into the book; adoption by grant;
- ``losses``: shards on lost nodes let go, replicas on lost nodes or sick GPUs replaced;
- ``slots``: one live replica per GPU and per slot (double claims, surplus);
- ``rollout``: replicas out of the catalog retired, changed ones replaced one at a time;
- ``failures``: failed shards fail their replica, restart backoff;
- ``progress``: a replica on its way up (Ready, later ranks dispatched to rank 0's rendezvous);
- ``cleanup``: retired replicas and strays stopped (drained first) and forgotten;
- ``placement``: missing slots placed, replicas created with their grants;
- ``drain``: replicas moved off draining nodes and sick replicas replaced, make before break;
- ``stopping``: retiring and stopping, the steps the passes above share;
- ``endpoints``: the rank-0 endpoints the router should know.
"""
