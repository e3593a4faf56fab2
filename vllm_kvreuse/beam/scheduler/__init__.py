"""Beam search in the engine core: the hook-layer feature and what it owns.

- ``feature.py``: the hook-layer feature: dispatches each hook to the parts
  below;
- ``groups.py``: the group table, the one owner of groups' membership and
  lifecycle (start, spawn, forget, drop);
- ``group.py``: a group's state, a beam's request;
- ``live.py``: live beams, one engine request per beam for the whole search
  (the live step strategy);
- ``as_one.py``: live groups stepped as one: members out of upstream's
  loop, each step added whole as extra rows (a group costs the host one
  request);
- ``lineage.py``: a group stepped as one keeps its beams as back-pointers,
  sequences built when read;
- ``sit_out.py``: which live members sit out a schedule, so that a group
  steps whole (groups stepped member by member);
- ``fork.py``: one new request per beam per step, ranked on the host (the
  fork step strategy);
- ``gate.py``: a step is admitted whole (members of one that does not fit
  are held out of the queue for a schedule);
- ``group_rule.py``: plain beams or beams in a SID catalog, one object per group.
"""
