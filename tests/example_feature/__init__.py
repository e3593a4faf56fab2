"""A feature that exists only to show what adding one takes (tests only).

It labels requests: a server flag turns it on, clients send a label with
each request, the scheduler side tallies the labels of live requests, and
the frontend counts final outputs in ``/metrics``.

- ``spec.py``: its declaration: the ``--enable-request-labels`` option, the
  public ``request_label`` key, its scheduler class and frontend hook;
- ``feature.py``: the scheduler feature (hooks ``on_add``, ``on_finish``);
- ``frontend.py``: the ``on_final_output`` hook;
- ``metrics.py``: its counter.

Adding it to the plugin would be one line in
``vllm_kvreuse/features.py:SPECS``; ``tests/unit/test_example_feature.py``
passes ``SPECS + (SPEC,)`` to the functions the shared tables are built by.
"""
