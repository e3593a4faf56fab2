"""The seam between the plugin and vLLM's internal state, one module a side.

Every read and write of upstream state that the features and services
need, beyond what a public upstream method does for them, is made in one
of these modules; the services and the features decide, these apply:

- :mod:`.scheduler`: the engine core's scheduler (:class:`~.scheduler.Upstream`:
  the block pool and tables, the running and waiting queues and the seat
  limits, the step output's parallel lists), the block accounting's view of
  it, and a request's block ids for a connector;
- :mod:`.requests`: one request's private state in the scheduler (its token
  lists, hasher and block hashes, its sampling params' derived stop sets);
- :mod:`.extra_rows`: rows a step runs that upstream's loop never walks
  (added after ``schedule()``, hidden from ``update_from_output``);
- :mod:`.frontend`: the API server's and the engine client's (a request's
  LoRA adapter, the number of API-server processes);
- :mod:`.worker`: the workers' (the KV packing vLLM's CPU attention chose).

Each upstream attribute touched here is registered per vLLM release in
:data:`vllm_kvreuse.patches.upstream_state.UPSTREAM_STATE` (owner class,
why, the module of this package that touches it, and the method's
signature or the attribute's presence); ``tests/unit/test_upstream_state.py``
checks every entry on real upstream objects, ``tests/unit/test_private_access.py``
that no other module reaches into them (an entry may name a registered
patch's own module instead) and that the package touches no unregistered
private attribute.
"""
